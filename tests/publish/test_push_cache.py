"""The push cache takes a pushed file without copying it, and survives a trainer that rewrites files in place."""

from __future__ import annotations

import os

import numpy as np
import pytest

from deltafs.publish import push
from deltafs.read.dest import LocalCheckpoint
from deltafs.read.pull import pull
from deltafs.store.repo import Repository
from deltafs.testing.checkpoints import files_of, perturb, write_safetensors


def _write(path, data: bytes) -> None:
    write_safetensors(str(path / "model.safetensors"), {"w": ("BF16", (len(data) // 2,), data)})


def _cache_file(cache: str) -> os.stat_result:
    state = LocalCheckpoint(os.path.join(cache, "base")).state()
    assert state is not None
    return os.stat(os.path.join(state.path, "model.safetensors"))


def _pushed_once(tmp_path, seed: int, size: int):
    """(rng, data, store, cache, src): one BF16 tensor of size random bytes in src, pushed as version 1."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    store, cache = str(tmp_path / "store"), str(tmp_path / "cache")
    src = tmp_path / "src"
    src.mkdir()
    _write(src, data)
    push(store, str(src), cache_dir=cache)
    return rng, data, store, cache, src


def test_the_cache_links_new_files_and_copies_once_a_file_is_rewritten_in_place(tmp_path):
    rng, data, store, cache, src = _pushed_once(tmp_path, 0, 1 << 20)
    st = os.stat(src / "model.safetensors")
    # On a filesystem with reflinks the cache file is a clone (another inode); else a hard link.
    linked = (_cache_file(cache).st_dev, _cache_file(cache).st_ino) == (st.st_dev, st.st_ino)
    # The trainer rewrites the same file in place (same inode): the base the cache held is gone.
    for _step in range(3):
        data = perturb(data, 2, 0.01, rng)
        with open(src / "model.safetensors", "r+b") as fh:
            fh.seek(os.path.getsize(src / "model.safetensors") - len(data))
            fh.write(data)
        res = push(store, str(src), cache_dir=cache)
        assert res.kind == "delta" and res.changed_fraction < 0.05
        pull(store, str(tmp_path / "dest"))
        assert files_of(tmp_path / "dest") == files_of(src)
    if linked:
        assert os.path.exists(os.path.join(cache, "no-link"))
        assert (_cache_file(cache).st_ino) != os.stat(src / "model.safetensors").st_ino


def test_a_rewrite_in_place_that_keeps_the_old_mtime_stops_the_linking_too(tmp_path):
    """cp -p or rsync --inplace -t rewrite the same inode and keep its mtime: the cache's hard-linked base changed
    unseen, every push re-derived its base from the store and keyframes lost their bridges (adversarial pass).
    The first push that finds the linked base changed sets no-link; the next pushes keep their cache."""
    rng, data, store, cache, src = _pushed_once(tmp_path, 1, 1 << 20)
    path = src / "model.safetensors"
    if (_cache_file(cache).st_dev, _cache_file(cache).st_ino) != (os.stat(path).st_dev, os.stat(path).st_ino):
        pytest.skip("the cache cloned the file (reflinks): nothing is shared")
    rederived = []
    for _step in range(3):
        data = perturb(data, 2, 0.01, rng)
        before = os.stat(path)
        with open(path, "r+b") as fh:
            fh.seek(os.path.getsize(path) - len(data))
            fh.write(data)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        res = push(store, str(src), cache_dir=cache)
        rederived.append(res.base_rederived)
        pull(store, str(tmp_path / "dest"))
        assert files_of(tmp_path / "dest") == files_of(src)
    assert rederived == [True, False, False]
    assert os.path.exists(os.path.join(cache, "no-link"))


def _two_tensor_ckpt(path, a: bytes, b: bytes) -> None:
    write_safetensors(str(path / "model.safetensors"),
                      {"a": ("BF16", (len(a) // 2,), a), "b": ("BF16", (len(b) // 2,), b)})


def _first_push(tmp_path, rng, size: int) -> tuple[str, str, object, bytes, bytes]:
    """Version 1 of a two-tensor checkpoint pushed with a cache that may not link (so later pushes patch it)."""
    a, b = (rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(2))
    store, cache, src = str(tmp_path / "store"), str(tmp_path / "cache"), tmp_path / "src"
    src.mkdir()
    _two_tensor_ckpt(src, a, b)
    Repository.open(store, create=True, chunk_bytes=1 << 20)  # several chunks per tensor
    push(store, str(src), cache_dir=cache, link="copy")
    return store, cache, src, a, b


def test_a_cache_that_cannot_link_is_patched_in_place_with_only_the_changed_chunks(tmp_path):
    rng = np.random.default_rng(1)
    store, cache, src, a, b = _first_push(tmp_path, rng, 3 << 20)
    first = _cache_file(cache)
    for _step in range(3):
        a = perturb(a, 2, 0.01, rng)  # b stays: its chunks are never written
        _two_tensor_ckpt(src, a, b)
        res = push(store, str(src), cache_dir=cache, link="copy")
        assert res.kind == "delta" and not res.base_rederived
        now = _cache_file(cache)
        assert (now.st_ino, now.st_nlink) == (first.st_ino, 1)  # the same file, rewritten where it changed
        assert files_of(LocalCheckpoint(os.path.join(cache, "base")).state().path) == files_of(src)
        pull(store, str(tmp_path / "dest"))
        assert files_of(tmp_path / "dest") == files_of(src)
    # Only the cache's own version directory remains beside it: no stale stage, no second copy.
    assert [n for n in os.listdir(os.path.join(cache, "base.deltafs")) if not n.endswith(".json")
            and n != "push.lock"] == [os.path.basename(LocalCheckpoint(os.path.join(cache, "base")).state().path)]


def test_a_cache_file_that_another_name_shares_is_never_patched(tmp_path):
    rng = np.random.default_rng(2)
    data = rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    store, cache, src = str(tmp_path / "store"), str(tmp_path / "cache"), tmp_path / "src"
    src.mkdir()
    _write(src, data)
    push(store, str(src), cache_dir=cache, link="copy")
    state = LocalCheckpoint(os.path.join(cache, "base")).state()
    other = tmp_path / "someone-elses-name"
    os.link(os.path.join(state.path, "model.safetensors"), other)  # e.g. the keyframe cache's hard link
    before = other.read_bytes()
    _write(src, perturb(data, 2, 0.01, rng))
    push(store, str(src), cache_dir=cache, link="copy")
    assert other.read_bytes() == before
    assert _cache_file(cache).st_ino != os.stat(other).st_ino


def test_a_push_that_fails_while_patching_leaves_no_cached_version_and_the_next_rebuilds_it(tmp_path, monkeypatch):
    from deltafs.publish import encode

    rng = np.random.default_rng(3)
    store, cache, src, a, b = _first_push(tmp_path, rng, 2 << 20)
    a2 = perturb(a, 2, 0.02, rng)
    _two_tensor_ckpt(src, a2, perturb(b, 2, 0.02, rng))
    real_put, calls = encode.Encoder._put, []

    def failing_put(self, oid, payload):
        calls.append(oid)
        if len(calls) > 2:  # some chunks are patched into the cache by now
            raise OSError(5, "store went away")
        return real_put(self, oid, payload)

    monkeypatch.setattr(encode.Encoder, "_put", failing_put)
    with pytest.raises(OSError):
        push(store, str(src), cache_dir=cache, link="copy")
    monkeypatch.setattr(encode.Encoder, "_put", real_put)
    # Half-patched bytes are never taken for a version: no cached version, no stage left.
    assert LocalCheckpoint(os.path.join(cache, "base")).state() is None
    assert not [n for n in os.listdir(os.path.join(cache, "base.deltafs")) if n.startswith("staging-")]
    res = push(store, str(src), cache_dir=cache, link="copy")
    assert res.version == 2 and res.kind == "delta" and res.base_rederived
    pull(store, str(tmp_path / "dest"))
    assert files_of(tmp_path / "dest") == files_of(src)


def test_a_new_layout_is_not_patched_and_still_pushes_right(tmp_path):
    rng = np.random.default_rng(4)
    a, b = (rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes() for _ in range(2))
    store, cache, src = str(tmp_path / "store"), str(tmp_path / "cache"), tmp_path / "src"
    src.mkdir()
    _two_tensor_ckpt(src, a, b)
    push(store, str(src), cache_dir=cache, link="copy")
    first = _cache_file(cache)
    write_safetensors(str(src / "model.safetensors"),  # same tensors, other order: every offset moves
                      {"b": ("BF16", (len(b) // 2,), b), "a": ("BF16", (len(a) // 2,), perturb(a, 2, 0.01, rng))})
    res = push(store, str(src), cache_dir=cache, link="copy")
    assert res.kind == "delta"
    assert _cache_file(cache).st_ino != first.st_ino
    pull(store, str(tmp_path / "dest"))
    assert files_of(tmp_path / "dest") == files_of(src)


def _cleanup_threads() -> list:
    import threading

    return [t for t in threading.enumerate() if t.name == "deltafs-cleanup"]


def test_the_previous_cache_version_is_freed_after_the_push_returns_and_nothing_of_it_stays(tmp_path):
    # The trainer keeps only its newest checkpoint: after it deletes step 1, the cache holds the only link to it.
    rng, data, store, cache, step1 = _pushed_once(tmp_path, 3, 1 << 20)
    old = LocalCheckpoint(os.path.join(cache, "base")).state()
    assert old is not None
    os.unlink(step1 / "model.safetensors")
    step2 = tmp_path / "step2"
    step2.mkdir()
    _write(step2, perturb(data, 2, 0.01, rng))
    res = push(store, str(step2), cache_dir=cache)
    assert res.kind == "delta"
    # The old version stopped being one before push returned; only its files may still be on their way out.
    assert not os.path.exists(old.path) and not os.path.exists(old.path + ".json")
    for t in _cleanup_threads():
        t.join(timeout=30)
    now = LocalCheckpoint(os.path.join(cache, "base")).state()
    assert now is not None and now.version == 2
    current = os.path.basename(now.path)
    sidecar = os.path.join(cache, "base.deltafs")
    assert sorted(n for n in os.listdir(sidecar) if not n.endswith(".lock")) == [current, current + ".json"]
    pull(store, str(tmp_path / "dest"))
    assert files_of(tmp_path / "dest") == files_of(step2)


def test_cleanup_in_the_background_removes_what_a_killed_deletion_left_and_never_follows_links(tmp_path):
    _rng, _data, _store, cache, _src = _pushed_once(tmp_path, 4, 1 << 16)
    # What a process killed during its background deletion leaves: a staging directory, here with a planted
    # symlink to a directory outside the cache.
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    leftover = os.path.join(cache, "base.deltafs", "staging-0123456789ab")
    os.mkdir(leftover)
    with open(os.path.join(leftover, "model.safetensors"), "wb") as fh:
        fh.write(b"\0" * 4096)
    os.symlink(outside, os.path.join(leftover, "link"))
    local = LocalCheckpoint(os.path.join(cache, "base"))
    assert local.cleanup(keep=1, background=True) == ["staging-0123456789ab"]
    assert local.deleting is not None
    local.deleting.join(timeout=30)
    assert not os.path.exists(leftover)
    assert (outside / "keep.txt").read_text() == "mine"
    assert local.state() is not None and local.check_files(local.state()) is None
