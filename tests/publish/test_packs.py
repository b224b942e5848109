"""Small chunks share stored objects (packs, format 3): fewer objects, the same bytes back, and gc, verify and
damage handling treat a pack like any object."""

from __future__ import annotations

import os

import numpy as np
import pytest

from deltafs.errors import IntegrityError
from deltafs.format.manifest import chunk_key, payload_bytes
from deltafs.maintenance.gc import gc
from deltafs.maintenance.inspect import show
from deltafs.maintenance.verify import verify
from deltafs.publish import push
from deltafs.read import rebuild
from deltafs.read.pull import local_version, pull
from deltafs.store.repo import Repository
from deltafs.testing.checkpoints import file_digests, write_safetensors

TENSORS = 300


def _write(path, step: int) -> None:
    """TENSORS small F32 tensors (norms, biases) and one 1 MiB bf16 matrix; every step moves all of them a little."""
    rng = np.random.default_rng(0)
    tensors = {}
    for i in range(TENSORS):
        base = rng.standard_normal(int(rng.integers(16, 2048))).astype(np.float32)
        tensors[f"layers.{i // 4}.m{i % 4}.weight"] = ("F32", base.shape, (base * (1 + 1e-6 * step)).tobytes())
    zeros = np.zeros(512, np.float32)
    tensors["zeros.a"] = ("F32", zeros.shape, zeros.tobytes())  # identical payloads within one run
    tensors["zeros.b"] = ("F32", zeros.shape, zeros.tobytes())
    big = rng.integers(0, 1 << 16, 512 * 1024, dtype=np.uint16)
    flip = np.random.default_rng(step).random(big.size) < 0.02 * bool(step)
    big[flip] ^= 1
    tensors["lm_head.weight"] = ("BF16", (512, 1024), big.tobytes())
    os.makedirs(path, exist_ok=True)
    write_safetensors(os.path.join(path, "model.safetensors"), tensors)


def _objects_on_disk(store: str) -> set[str]:
    return {name for _d, _s, names in os.walk(os.path.join(store, "chunks")) for name in names}


def test_small_tensors_share_objects_and_every_version_reads_back(tmp_path):
    store = str(tmp_path / "store")
    cache = str(tmp_path / "cache")
    sources = []
    for step in range(3):
        src = str(tmp_path / f"src{step}")
        _write(src, step)
        push(store, src, cache_dir=cache)
        sources.append(src)
    repo = Repository.open(store)
    for v in (1, 2, 3):
        man = repo.manifest(v)
        assert man.format_version == 3
        records = [c for f in man.files for s in f.segments for c in s.chunks if c.object is not None]
        packed = [c for c in records if c.pack is not None]
        assert len(packed) >= TENSORS  # every small tensor changed and went into a pack
        assert len({c.object for c in records}) < len(records) / 20
        same = {(c.object, c.pack) for f in man.files for s in f.segments for c in s.chunks
                if s.key in ("t:zeros.a", "t:zeros.b") and c.object is not None}
        assert v > 1 or len(same) == 1  # the two zero tensors name one range of one pack
    assert _objects_on_disk(store) == {c.object for v in (1, 2, 3) for f in repo.manifest(v).files
                                       for s in f.segments for c in s.chunks if c.object is not None}
    assert verify(store, all_versions=True, deep=True).ok
    dest = str(tmp_path / "dest")
    pull(store, dest, version=1)
    for v, src in ((2, sources[1]), (3, sources[2])):
        res = pull(store, dest, version=v)  # an update: deltas decoded from packs over the local base
        assert res.version == v and not res.fallback
        assert file_digests(dest) == file_digests(src)
    cold = str(tmp_path / "cold")
    assert pull(store, cold).version == 3 and file_digests(cold) == file_digests(sources[2])


def test_show_counts_a_payload_that_tensors_share_once(tmp_path):
    """zeros.a and zeros.b name one range of one pack: each tensor's stored bytes count it, the file and the
    version count it once, and the version's figure is the bytes of the distinct ranges its records name."""
    store, src = str(tmp_path / "store"), str(tmp_path / "src")
    _write(src, 0)
    push(store, src)
    info = show(store)
    by = {t.name: t for t in info.tensors}
    shared = by["zeros.a"].stored
    assert shared > 0 and by["zeros.b"].stored == shared
    files = Repository.open(store).manifest(1).files
    records = [c for f in files for s in f.segments for c in s.chunks]
    ranges = {(c.object, c.pack[0] if c.pack else 0): c.stored for c in records if c.object is not None}
    assert info.stored == sum(ranges.values()) == payload_bytes(records)
    assert sum(c.stored for c in records if c.object is not None) == info.stored + shared
    in_model = [c for f in files if f.path == "model.safetensors" for s in f.segments for c in s.chunks]
    model = next(f for f in info.files if f.path == "model.safetensors")
    assert model.stored == sum(c.stored for c in in_model if c.object is not None) - shared
    assert info.to_json()["stored"] == info.stored


def test_a_pull_reads_each_pack_once_and_a_tiny_memo_still_gives_the_right_bytes(tmp_path, monkeypatch, object_reads):
    store = str(tmp_path / "store")
    src = str(tmp_path / "src")
    _write(src, 0)
    push(store, src, cache_dir=str(tmp_path / "cache"))
    object_reads.clear()
    res = pull(store, str(tmp_path / "a"), threads=4)
    assert set(object_reads.values()) == {1}
    assert res.bytes_read == sum(os.path.getsize(os.path.join(store, k)) for k in object_reads)
    # A memo too small for any pack: every chunk fetches its pack again, and the bytes are still right.
    monkeypatch.setattr(rebuild.ChunkSource, "MEMO_BYTES", 1)
    object_reads.clear()
    pull(store, str(tmp_path / "b"), threads=4)
    assert max(object_reads.values()) > 1
    assert file_digests(str(tmp_path / "b")) == file_digests(src)


def test_a_damaged_pack_is_named_and_dest_keeps_its_version(tmp_path, object_reads):
    store = str(tmp_path / "store")
    for step in range(2):
        _write(str(tmp_path / f"src{step}"), step)
        push(store, str(tmp_path / f"src{step}"), cache_dir=str(tmp_path / "cache"))
    dest = str(tmp_path / "dest")
    pull(store, dest, version=1)
    before = file_digests(dest)
    man = Repository.open(store).manifest(2)
    pack = next(c.object for f in man.files for s in f.segments for c in s.chunks if c.pack is not None)
    path = os.path.join(store, chunk_key(pack))
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x10
    os.chmod(path, 0o644)
    open(path, "wb").write(bytes(data))
    rep = verify(store, version=2)
    assert not rep.ok and any(pack in p for p in rep.problems)
    object_reads.clear()
    with pytest.raises(IntegrityError) as err:
        pull(store, dest, threads=4)
    assert pack in str(err.value)
    assert file_digests(dest) == before and local_version(dest).version == 1
    # Dozens of chunks name the pack; it is fetched with the store's retries once per attempt at the version (the
    # delta path, then the fallback from the full version), not once per chunk.
    attempts = Repository.open(store).objects.retry.attempts
    assert object_reads[chunk_key(pack)] <= 2 * attempts


def test_gc_keeps_the_packs_of_kept_versions_and_removes_the_rest(tmp_path):
    store = str(tmp_path / "store")
    for step in range(3):
        _write(str(tmp_path / f"src{step}"), step)
        push(store, str(tmp_path / f"src{step}"), cache_dir=str(tmp_path / "cache"), keyframe_every=1)
    repo = Repository.open(store)
    kept = {c.object for f in repo.manifest(3).files for s in f.segments for c in s.chunks if c.object is not None}
    before = _objects_on_disk(store)
    res = gc(store, keep_last=1, grace=0)
    after = _objects_on_disk(store)
    assert kept <= after < before and res.chunks_removed == len(before - after)
    cold = str(tmp_path / "cold")
    assert pull(store, cold).version == 3
    assert file_digests(cold) == file_digests(str(tmp_path / "src2"))
    assert verify(store, all_versions=True, deep=True).ok


def test_a_store_error_is_tried_again_and_a_damaged_pack_is_not(tmp_path, monkeypatch, object_reads):
    """A reader that several calls share (open_version) remembers only final failures: a dropped connection on one
    call does not fail the next one, a pack still damaged after the store's retries fails every chunk at once."""
    from deltafs.errors import StoreError
    from deltafs.read.inspect import open_version

    store = str(tmp_path / "store")
    _write(str(tmp_path / "src"), 0)
    push(store, str(tmp_path / "src"), cache_dir=str(tmp_path / "cache"))
    real_get_chunk = Repository.get_chunk
    failures = [1]

    def flaky(self, oid, size=None):  # type: ignore[no-untyped-def]
        if failures[0]:
            failures[0] -= 1
            raise StoreError("connection reset by peer")
        return real_get_chunk(self, oid, size)

    monkeypatch.setattr(Repository, "get_chunk", flaky)
    reader = open_version(store, 1)
    with pytest.raises(StoreError):
        reader.tensor_bytes("layers.0.m1.weight")
    assert reader.tensor_bytes("layers.0.m1.weight") == reader.tensor_bytes("layers.0.m1.weight")
    monkeypatch.setattr(Repository, "get_chunk", real_get_chunk)

    man = Repository.open(store).manifest(1)
    rec = next(c for f in man.files for s in f.segments for c in s.chunks if s.key == "t:layers.5.m0.weight")
    assert rec.pack is not None
    path = os.path.join(store, chunk_key(rec.object))
    os.chmod(path, 0o644)
    with open(path, "r+b") as fh:
        fh.seek(rec.pack[0])
        fh.write(b"\xff\xfe")
    reader = open_version(store, 1)
    object_reads.clear()
    for name in ("layers.5.m0.weight", "layers.5.m1.weight", "layers.5.m2.weight"):  # one run, one pack
        with pytest.raises(IntegrityError):
            reader.tensor_bytes(name)
    attempts = Repository.open(store).objects.retry.attempts
    assert object_reads[chunk_key(rec.object)] == attempts  # fetched with its retries once, not once per tensor
