"""Base consistency: deltas name their base's digest; trainers and readers never apply one to another base."""

from __future__ import annotations

import os

import pytest

from deltafs.errors import IntegrityError
from deltafs.format.manifest import manifest_key
from deltafs.maintenance.verify import verify
from deltafs.publish import push
from deltafs.read.pull import pull
from deltafs.store.repo import Repository
from deltafs.testing.checkpoints import CheckpointMaker, files_of, run_cli

from history_helpers import push_history


def test_every_delta_records_its_parents_digest(tmp_path, maker):
    store = str(tmp_path / "store")
    push_history(store, maker, 6, keyframe_every=3)
    repo = Repository.open(store)
    for v in repo.versions():
        man = repo.manifest(v)
        if v > 1:
            assert man.parent == v - 1 and man.parent_digest == repo.manifest(v - 1).digest
        else:
            assert man.parent is None and man.parent_digest is None


def _cache_state_path(cache: str) -> str:
    base = os.path.join(cache, "base")
    return os.path.join(os.path.dirname(base), os.readlink(base))


def test_resumed_trainer_rederives_its_base_from_the_store(tmp_path, maker):
    store = str(tmp_path / "store")
    cache = str(tmp_path / "cache")
    push(store, maker.write(), cache_dir=cache)
    maker.advance()
    res = push(store, maker.write(), cache_dir=cache)
    assert res.kind == "delta" and not res.base_rederived  # the cache held HEAD
    # Restart on a new host (no cache), from the trainer's own checkpoint: the base comes from the store.
    maker.advance()
    src3 = maker.write()
    res = push(store, src3, cache_dir=str(tmp_path / "new-host"))
    assert res.kind == "delta" and res.base_rederived and res.parent == 2
    pull(store, str(tmp_path / "d"))
    assert files_of(tmp_path / "d") == files_of(src3)


def test_stale_cache_after_another_writer_is_not_used(tmp_path, maker):
    store = str(tmp_path / "store")
    a, b = str(tmp_path / "cache-a"), str(tmp_path / "cache-b")
    push(store, maker.write(), cache_dir=a)
    maker.advance()
    push(store, maker.write(), cache_dir=b)  # another trainer moved HEAD to 2; cache a still holds 1
    maker.advance()
    src = maker.write()
    res = push(store, src, cache_dir=a)
    assert res.base_rederived and res.parent == 2
    assert Repository.open(store).manifest(3).parent_digest == Repository.open(store).manifest(2).digest
    pull(store, str(tmp_path / "d"))
    assert files_of(tmp_path / "d") == files_of(src)


def test_corrupt_cache_claiming_head_is_detected_and_rederived(tmp_path, maker):
    store = str(tmp_path / "store")
    cache = str(tmp_path / "cache")
    push(store, maker.write(), cache_dir=cache)
    maker.advance()
    # The cache says "version 1" but a tensor's bytes are not version 1's (bit rot, a crashed writer).
    version_dir = _cache_state_path(cache)
    shard = os.path.join(version_dir, "model.safetensors")
    os.chmod(shard, 0o644)
    with open(shard, "r+b") as fh:
        fh.seek(os.path.getsize(shard) - 100)
        fh.write(b"\xff" * 8)
    src = maker.write()
    res = push(store, src, cache_dir=cache)
    assert res.kind == "delta" and res.base_rederived
    for v, path in [(2, src)]:
        pull(store, str(tmp_path / f"d{v}"), version=v)
        assert files_of(tmp_path / f"d{v}") == files_of(path)
    assert verify(store, all_versions=True).ok


def test_rewritten_store_with_same_version_numbers(tmp_path):
    """A store wiped and pushed again: the cache and the reader hold a version 2 with another digest."""
    store = str(tmp_path / "store")
    cache = str(tmp_path / "cache")
    m1 = CheckpointMaker(tmp_path / "run1", seed=1)
    push_history(store, m1, 2, cache_dir=cache)
    reader = tmp_path / "reader"
    pull(store, str(reader))  # reader holds run 1's version 2
    import shutil

    shutil.rmtree(store)
    m2 = CheckpointMaker(tmp_path / "run2", seed=2)
    srcs = push_history(store, m2, 3, cache_dir=cache)  # cache: other store id -> rederived, never reused
    res = pull(store, str(reader), force=True)  # another store id: only with --force
    assert res.version == 3 and res.from_full
    assert files_of(reader) == files_of(srcs[3])


def test_reader_whose_base_has_another_digest_falls_back_to_a_full_version(tmp_path, maker):
    """History rewritten under the same version numbers: the reader's version 2 is not the store's version 2."""
    store = str(tmp_path / "store")
    srcs = push_history(store, maker, 2, keyframe_every=100)
    reader = tmp_path / "reader"
    pull(store, str(reader))
    repo = Repository.open(store)
    # Replace versions 2 (same number, other bytes) and add 3 on top of it.
    repo.objects.delete(manifest_key(2))
    repo.objects.put("HEAD", repo.read_head().__class__(1, repo.manifest(1).digest).to_bytes())
    other = CheckpointMaker(tmp_path / "other", seed=9)
    new2 = push(store, other.write(), keyframe_every=100, cache_dir=str(tmp_path / "c2"))
    other.advance()
    src3 = other.write()
    push(store, src3, keyframe_every=100, cache_dir=str(tmp_path / "c2"))
    assert new2.version == 2
    res = pull(store, str(reader))
    # The reader's local version 2 does not match version 3's base: the chain starts at full version 1.
    assert res.version == 3 and res.from_full
    assert files_of(reader) == files_of(src3)
    assert files_of(reader) != files_of(srcs[2])


def test_delta_whose_recorded_base_digest_mismatches_is_refused(tmp_path, maker):
    """A manifest whose parent_digest names another base than the store's parent: pull refuses, DEST intact."""
    store = str(tmp_path / "store")
    srcs = push_history(store, maker, 2, keyframe_every=100)
    dest = tmp_path / "dest"
    pull(store, str(dest), version=1)
    repo = Repository.open(store)
    from dataclasses import replace

    bad = replace(repo.manifest(2), version=3, parent=2, parent_digest="sha256:" + "0" * 64).seal()
    repo.objects.put(manifest_key(3), bad.encode())
    with pytest.raises(IntegrityError, match="base digest mismatch"):
        pull(store, str(dest), version=3)
    assert files_of(dest) == files_of(srcs[1])
    proc = run_cli("pull", store, dest)
    assert proc.returncode == 6 and "base digest mismatch" in proc.stderr
    assert not verify(store, version=3).ok
