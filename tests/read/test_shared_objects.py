"""A pull fetches an object that several chunks share once, and an object only one chunk needs without the memo."""

from __future__ import annotations

import numpy as np
from safetensors.numpy import save_file

from deltafs.publish import push
from deltafs.read import rebuild
from deltafs.read.pull import pull


def test_shared_objects_are_read_once_and_only_they_take_the_memo(tmp_path, monkeypatch, object_reads):
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    # Tensors above the encoder's small-chunk size (256 KiB), so each chunk is its own object, not part of a pack.
    tensors = {f"zero.{i}": np.zeros(70_000, np.float32) for i in range(6)}  # six chunks, one object
    tensors.update({f"rand.{i}": rng.standard_normal(70_000).astype(np.float32) for i in range(3)})
    save_file(tensors, str(src / "model.safetensors"))
    store = str(tmp_path / "store")
    push(store, str(src), cache_dir=str(tmp_path / "cache"))

    memo_calls: list[bool] = []
    real_get = rebuild.ChunkSource.get

    def recording_get(self, rec, shared=True):  # type: ignore[no-untyped-def]
        memo_calls.append(shared)
        return real_get(self, rec, shared)

    object_reads.clear()
    monkeypatch.setattr(rebuild.ChunkSource, "get", recording_get)
    pull(store, str(tmp_path / "dest"), threads=4)

    assert sorted(object_reads.values()) == [1] * len(object_reads)  # every object read once
    # The header, three random tensors: one chunk each; the six zero tensors: one object for all of them.
    assert len(object_reads) == 5
    assert sorted(memo_calls) == [False] * 4 + [True] * 6
    got = (tmp_path / "dest" / "model.safetensors").read_bytes()
    assert got == (src / "model.safetensors").read_bytes()



def test_a_reader_that_reads_a_tensor_again_fetches_its_objects_once(tmp_path, object_reads):
    from deltafs.read.inspect import open_version

    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(1)
    save_file({f"t.{i}": rng.standard_normal(256).astype(np.float32) for i in range(3)}, str(src / "model.safetensors"))
    store = str(tmp_path / "store")
    push(store, str(src), cache_dir=str(tmp_path / "cache"))
    object_reads.clear()
    reader = open_version(store, 1)  # one source for every tensor it reads: each object is kept once read
    first = reader.tensor_bytes("t.1")
    assert reader.tensor_bytes("t.1") == first and reader.tensor_bytes("t.2") != first
    assert list(object_reads.values()) == [1]  # the small tensors' payloads (and the header) are one pack, read once
