"""Stores written before this format still pull and verify, and take this release's pushes on top: format 1
(deltafs 0.1, tests/data/v1_store) and format 2 (before packs, at d4f1857, tests/data/v2_store)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from deltafs.format.manifest import FORMAT_VERSION
from deltafs.maintenance.verify import verify
from deltafs.publish import push
from deltafs.read.pull import local_version, pull
from deltafs.store.repo import Repository
from deltafs.testing.checkpoints import file_digests

DATA = os.path.join(os.path.dirname(__file__), "..", "data")


def _expected(fmt: int) -> dict[str, dict[str, str]]:
    with open(os.path.join(DATA, f"v{fmt}_store", "expected_sha256.json")) as fh:
        return json.load(fh)  # type: ignore[no-any-return]


@pytest.fixture(params=[1, 2], ids=["format1", "format2"])
def old_store(request, tmp_path):
    """(format, a copy of the store kept as data)."""
    path = tmp_path / "store"
    shutil.copytree(os.path.join(DATA, f"v{request.param}_store", "store"), path)
    return request.param, str(path)


def test_every_old_version_pulls_byte_exact_and_verifies(tmp_path, old_store):
    fmt, store = old_store
    expected = _expected(fmt)
    repo = Repository.open(store)
    # Format 2 stores kept format 2's store config; only manifests changed in format 3.
    assert repo.config.format_version == fmt and repo.versions() == [1, 2, 3, 4]
    assert {repo.manifest(v).format_version for v in repo.versions()} == {fmt}
    assert verify(store, all_versions=True).ok
    for v in repo.versions():
        dest = tmp_path / f"cold{v}"
        res = pull(store, str(dest), version=v)
        assert res.version == v
        assert file_digests(dest) == expected[str(v)]
        assert verify(store, local=str(dest)).ok


def test_an_update_pull_over_an_old_base_and_a_push_on_top(tmp_path, old_store):
    fmt, store = old_store
    expected = _expected(fmt)
    dest = tmp_path / "dest"
    pull(store, str(dest), version=2)
    res = pull(store, str(dest))  # 2 -> 4 as deltas over an old-format local base
    assert res.version == 4 and not res.fallback and not res.from_full
    assert file_digests(dest) == expected["4"]
    # This release pushes its own manifests (format 3: small chunks packed) into the old store; the next pull
    # applies one over the old base.
    src = tmp_path / "src"
    shutil.copytree(local_version(str(dest)).path, src)
    (src / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 48, "edited": true}\n')
    for shard in src.glob("*.safetensors"):  # every tensor moves: the lowest bit of one byte in 50
        data = bytearray(shard.read_bytes())
        start = 8 + int.from_bytes(data[:8], "little")
        for i in range(start, len(data), 50):
            data[i] ^= 1
        shard.write_bytes(bytes(data))
    pushed = push(store, str(src), cache_dir=str(tmp_path / "cache"))
    assert pushed.version == 5
    man = Repository.open(store).manifest(5)
    assert man.format_version == FORMAT_VERSION == 3
    assert any(c.pack is not None for f in man.files for seg in f.segments for c in seg.chunks)
    res = pull(store, str(dest))
    assert res.version == 5 and not res.fallback
    assert file_digests(dest) == file_digests(src)
    assert verify(store, all_versions=True, deep=True).ok


def test_a_dest_pulled_by_0_1_is_still_ours(tmp_path):
    """A DEST whose state record 0.1 wrote is recognized and updated, not refused as foreign (exit 9)."""
    from deltafs.read.dest import LocalCheckpoint

    store = str(tmp_path / "store")
    shutil.copytree(os.path.join(DATA, "v1_store", "store"), store)
    dest = str(tmp_path / "dest")
    pull(store, dest, version=1)
    state_file = os.path.realpath(dest) + ".json"
    raw = json.loads(open(state_file).read())
    # Exactly the keys and format name 0.1's deltafs/local.py wrote (no file stamps, isoformat time).
    old = {k: raw[k] for k in ("digest", "manifest", "store_id", "store_url", "version")}
    old.update({"format": "deltafs.local", "installed": "2026-12-01T02:15:49.991253+00:00"})
    with open(state_file, "w") as fh:
        fh.write(json.dumps(old, sort_keys=True, separators=(",", ":")))
    assert LocalCheckpoint(dest).state() is not None
    assert pull(store, dest).version == 4


def test_diff_of_a_v1_store_counts_what_whole_tensors_count(tmp_path):
    """Format 1 segments carry one xxh3 stream digest, checked as diff streams the chunks."""
    import numpy as np

    from deltafs.maintenance.inspect import diff
    from deltafs.read.inspect import open_version

    store = str(tmp_path / "store")
    shutil.copytree(os.path.join(DATA, "v1_store", "store"), store)
    ra, rb = open_version(store, 1), open_version(store, 2)
    for row in diff(store, 1, 2):
        if row.status != "changed":
            continue
        a = np.frombuffer(ra.tensor_bytes(row.name), np.uint8)
        b = np.frombuffer(rb.tensor_bytes(row.name), np.uint8)
        width = len(b) // row.elements
        view = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
        assert row.changed == int(np.count_nonzero(a.view(view) != b.view(view))), row.name
