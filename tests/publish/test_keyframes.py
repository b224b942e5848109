"""Keyframes: a full version every K versions, or once the chain since the last one exceeds a budget."""

from __future__ import annotations

import os

import numpy as np

from deltafs.publish import DEFAULT_KEYFRAME_BUDGET, DEFAULT_KEYFRAME_EVERY, PushOptions, push
from deltafs.format.manifest import referenced_bytes
from deltafs.read.pull import pull
from deltafs.store.repo import Repository
from deltafs.testing.checkpoints import files_of, perturb, run_cli, write_safetensors

from history_helpers import bytes_needed, push_history


def _kinds(store: str) -> list[str]:
    repo = Repository.open(store)
    return [repo.manifest(v).kind for v in repo.versions()]


def test_a_full_version_every_k(tmp_path, maker):
    store = str(tmp_path / "store")
    push_history(store, maker, 10, keyframe_every=4, keyframe_budget=None)
    kinds = _kinds(store)
    assert [v for v, k in enumerate(kinds, 1) if k == "full"] == [1, 5, 9]
    repo = Repository.open(store)
    assert [repo.manifest(v).stats["since_full"] for v in repo.versions()] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    # `deltafs log` marks the full versions.
    out = run_cli("log", store, check=0).stdout.splitlines()[1:]
    marked = [int(line.split()[0]) for line in out if "full *" in line]
    assert marked == [1, 5, 9]


def test_a_full_version_once_the_chain_exceeds_the_budget(tmp_path, maker):
    maker.fraction = 0.2  # big steps: each delta is a sizeable part of a full version
    store = str(tmp_path / "store")
    push_history(store, maker, 10, keyframe_every=None, keyframe_budget=0.2)
    repo = Repository.open(store)
    mans = [repo.manifest(v) for v in repo.versions()]
    fulls = [m.version for m in mans if m.kind == "full"]
    assert len(fulls) >= 3, fulls  # the budget, not K, made keyframes
    for prev, man in zip(mans, mans[1:], strict=False):
        over = prev.stats["chain_bytes"] >= 0.2 * man.stats["full_bytes"]
        assert (man.kind == "full") == over, (man.version, prev.stats, man.stats)
    for prev, man in zip(mans, mans[1:], strict=False):  # chain_bytes: the deltas' bytes since the last full version
        want = 0 if man.kind == "full" else prev.stats["chain_bytes"] + referenced_bytes(man.files)
        assert man.stats["chain_bytes"] == want


def test_chain_bytes_count_what_readers_fetch_after_a_killed_push(tmp_path, maker):
    """A push killed after storing its chunks, then run again, finds them stored already: it writes (and reports as
    written) few bytes, but the delta a reader fetches is as large as ever, and the keyframe budget must count
    that (it bounds what a reader starting from nothing reads)."""
    import shutil

    store, again = str(tmp_path / "store"), str(tmp_path / "again")
    cache, cache_again = str(tmp_path / "cache"), str(tmp_path / "cache-again")
    push(store, maker.write(), cache_dir=cache)
    shutil.copytree(store, again, symlinks=True)  # the same store before version 2, with its own push cache
    shutil.copytree(cache, cache_again, symlinks=True)
    maker.advance()
    src = maker.write()
    first = push(store, src, cache_dir=cache)
    # What a killed attempt leaves: every chunk of version 2 stored, no manifest.
    shutil.copytree(os.path.join(store, "chunks"), os.path.join(again, "chunks"), dirs_exist_ok=True)
    retried = push(again, src, cache_dir=cache_again)
    one, two = Repository.open(store).manifest(2), Repository.open(again).manifest(2)
    assert retried.bytes_written < first.bytes_written and two.stats["chunk_bytes_stored"] == 0
    assert two.stats["chain_bytes"] == one.stats["chain_bytes"] == referenced_bytes(one.files) > 0


def test_defaults_are_documented_values_in_api_and_cli(tmp_path):
    assert (DEFAULT_KEYFRAME_EVERY, DEFAULT_KEYFRAME_BUDGET) == (50, 1.0)
    defaults = PushOptions()
    assert defaults.keyframe_every == 50 and defaults.keyframe_budget == 1.0
    help_text = " ".join(run_cli("push", "--help", check=0).stdout.split())
    assert "--keyframe-every" in help_text and "--keyframe-budget" in help_text and "[default: 50]" in help_text


def test_default_policy_makes_version_51_full(tmp_path):
    """With the defaults and tiny changes (budget never reached), versions 1 and 51 are full."""
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()
    store = str(tmp_path / "store")
    src = tmp_path / "src" / "model.safetensors"
    for _ in range(52):
        write_safetensors(str(src), {"w": ("BF16", (2048,), data)})
        push(store, str(src.parent), threads=1)
        data = perturb(data, 2, 0.001, rng)
    kinds = _kinds(store)
    assert [v for v, k in enumerate(kinds, 1) if k == "full"] == [1, 51]


def test_full_flag_and_cli_options(tmp_path, maker):
    store = str(tmp_path / "store")
    run_cli("push", maker.write(), store, check=0)
    maker.advance()
    run_cli("push", maker.write(), store, "--full", check=0)
    maker.advance()
    run_cli("push", maker.write(), store, "--keyframe-every", "2", check=0)  # since_full 0 -> due now? no: 1 < 2
    maker.advance()
    run_cli("push", maker.write(), store, "--keyframe-every", "2", check=0)
    maker.advance()
    run_cli("push", maker.write(), store, "--keyframe-every", "0", "--keyframe-budget", "0", check=0)
    assert _kinds(store) == ["full", "full", "delta", "full", "delta"]


def test_a_new_reader_starts_at_the_newest_full_version(tmp_path, maker):
    store = str(tmp_path / "store")
    srcs = push_history(store, maker, 7, keyframe_every=3)  # full 1, 4, 7
    res = pull(store, str(tmp_path / "dest"), version=6)
    assert res.from_full
    assert files_of(tmp_path / "dest") == files_of(srcs[6])
    repo = Repository.open(store)
    # What was read is exactly what version 4 and the deltas after it need; replaying from version 1 costs more.
    assert res.bytes_read == bytes_needed(repo, 6, None)
    assert res.bytes_read < sum(repo.manifest(v).stats["chunk_bytes_stored"] for v in range(1, 7))
