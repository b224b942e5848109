"""show, diff, log --limit/--since and pull --dry-run through the real command line."""

from __future__ import annotations

import json
import os

from deltafs.testing.checkpoints import run_cli


def _store(tmp_path, maker, n=3):
    store = tmp_path / "store"
    for step in range(n):
        run_cli("push", maker.write(), store, "--meta", f"step={step * 100}", "-q", check=0)
        maker.advance()
    return store


def test_show_lists_files_tensors_and_metadata(tmp_path, maker):
    store = _store(tmp_path, maker, n=2)
    info = json.loads(run_cli("show", store, "--json", check=0).stdout)
    assert info["version"] == 2 and info["head"] and info["metadata"] == {"step": 100}
    assert {f["path"] for f in info["files"]} == {"config.json", "model.safetensors", "tokenizer/tokenizer.json"}
    lm = next(t for t in info["tensors"] if t["name"] == "lm_head.weight")
    assert lm["dtype"] == "BF16" and lm["shape"] == [64, 48] and lm["nbytes"] == 64 * 48 * 2
    human = run_cli("show", store, "--version", "1", "--tensors", check=0).stdout
    assert "version 1 (full)" in human and "lm_head.weight" in human and "UTC" in human
    assert run_cli("show", store, "--version", "9").returncode != 0


def test_diff_counts_changed_elements(tmp_path, maker):
    store = _store(tmp_path, maker, n=2)
    data = json.loads(run_cli("diff", store, "1", "2", "--json", check=0).stdout)
    by = {t["name"]: t for t in data["tensors"]}
    assert by["model.norm.weight"]["status"] == "same"  # the maker leaves it alone on odd steps
    assert 0 < by["lm_head.weight"]["fraction"] < 0.05
    assert data["changed"] == sum(t["changed"] for t in data["tensors"])
    one = json.loads(run_cli("diff", store, "1", "2", "--tensor", "lm_head.weight", "--json", check=0).stdout)
    assert [t["name"] for t in one["tensors"]] == ["lm_head.weight"]


def test_log_limit_since_and_metadata(tmp_path, maker):
    store = _store(tmp_path, maker, n=3)
    newest = json.loads(run_cli("log", store, "--limit", "1", "--json", check=0).stdout)["versions"]
    assert [v["version"] for v in newest] == [3]
    since = json.loads(run_cli("log", store, "--since", "2", "--json", check=0).stdout)["versions"]
    assert [v["version"] for v in since] == [2, 3]
    assert json.loads(run_cli("log", store, "--since", "2999-01-01", "--json", check=0).stdout)["versions"] == []
    for prefix in ("2000-01", "2000-01-01 08:00", "2000-01-01T08:00:00Z"):  # digits alone are a version
        out = json.loads(run_cli("log", store, "--since", prefix, "--json", check=0).stdout)["versions"]
        assert [v["version"] for v in out] == [1, 2, 3], prefix
    # What matches nothing by accident (a typo, a month 13) or everything (a negative number) is refused, exit 2,
    # before the store is read.
    for bad in ("garbage", "2026-13-45", "2026-02-30", "-3", "2026-12-01T25:00", "12-01"):
        proc = run_cli("log", tmp_path / "no-store", "--since", bad)
        assert proc.returncode == 2 and "--since must be a version number or a UTC time" in proc.stderr, (bad, proc.stderr)
    human = run_cli("log", store, check=0).stdout
    assert "created (UTC)" in human and "step=200" in human


def test_pull_dry_run_changes_nothing(tmp_path, maker):
    store = _store(tmp_path, maker, n=2)
    dest = tmp_path / "dest"
    plan = json.loads(run_cli("pull", store, dest, "--dry-run", "--json", check=0).stdout)
    assert plan["version"] == 2 and plan["objects"] > 0 and not plan["up_to_date"]
    assert not os.path.lexists(dest) and not os.path.lexists(str(dest) + ".deltafs")
    run_cli("pull", store, dest, "-q", check=0)
    again = json.loads(run_cli("pull", store, dest, "--dry-run", "--json", check=0).stdout)
    assert again["up_to_date"] and again["objects"] == 0


def test_diff_counts_across_chunks_in_two_chunks_of_memory_and_checks_digests(tmp_path):
    """diff rebuilt both versions of a tensor whole (two copies each); now chunk by chunk, each chunk's count kept
    only once the segment digest matched."""
    import numpy as np

    from deltafs.errors import IntegrityError
    from deltafs.maintenance.inspect import diff
    from deltafs.publish import push
    from deltafs.store.repo import Repository
    from deltafs.testing.checkpoints import write_safetensors

    store = str(tmp_path / "store")
    Repository.open(store, create=True, chunk_bytes=4096)
    rng = np.random.default_rng(3)
    a = rng.standard_normal(10_000).astype(np.float32)  # 40 KB: ten chunks
    b = a.copy()
    b[rng.choice(10_000, 321, replace=False)] += 1
    for i, arr in enumerate((a, b)):
        src = tmp_path / f"v{i}"
        src.mkdir()
        write_safetensors(str(src / "model.safetensors"), {"w": ("F32", (10_000,), arr.tobytes())})
        push(store, str(src))
    rows = {r.name: r for r in diff(store, 1, 2)}
    assert rows["w"].changed == 321 and rows["w"].elements == 10_000
    # A segment digest that its chunks do not match (a re-sealed manifest): the diff fails, after its last chunk.
    import dataclasses

    from deltafs.format.manifest import manifest_key

    man = Repository.open(store).manifest(2)
    bad = dataclasses.replace(man, files=tuple(dataclasses.replace(f, segments=tuple(
        dataclasses.replace(s, digest="xxh3-tree:" + "0" * 32) if s.key == "t:w" else s for s in f.segments))
        for f in man.files)).seal()
    with open(os.path.join(store, manifest_key(2)), "wb") as fh:
        fh.write(bad.encode())
    try:
        diff(store, 1, 2)
        raise AssertionError("a segment whose digest does not match must fail the diff")
    except IntegrityError as exc:
        assert "digest mismatch" in str(exc)
