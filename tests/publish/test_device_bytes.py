"""Accelerator tensors are read a chunk at a time (DeviceBytes), so a push never holds the model in host memory.

This machine has no accelerator: DeviceBytes is exercised on CPU tensors, where its reads make private host copies
exactly as they do from a device (`Tensor.to("cpu", copy=True)`); which tensors take that path is tested on CPU
tensors only (they keep the zero-copy path).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from deltafs.publish import PushOptions, push_tensors
from deltafs.publish.hf import DeviceBytes, HfTensor, check_tensor, plan_checkpoint, tensor_bytes, write_files
from deltafs.publish.pipeline import RankWork, Solo, run
from deltafs.publish.source import memory_source
from deltafs.read.pull import pull
from deltafs.store.repo import Repository


def _weights(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = {
        # several 512 KiB chunks (over the encoder's 256 KiB SMALL_CHUNK: read into its recycled buffers), and a
        # short last one
        "big": torch.randn(1100, 700, generator=gen).bfloat16(),
        "norm": torch.randn(700, generator=gen),  # a tiny F32 tensor
        "mask": torch.rand(33, generator=gen) > 0.5,  # bool, an odd size
        "fp8": torch.randn(17, generator=gen).to(torch.float8_e4m3fn),
        "empty": torch.zeros(0, 4),
    }
    for t in (out["big"], out["norm"]):
        t.view(-1)[step :: 89] += 0.125 * step  # a trainer-like step: a few elements move
    return out


def _push_as_device(store: str, tensors: dict[str, torch.Tensor], cache: str, **kw: object) -> object:
    """push_tensors' own steps, with every tensor behind DeviceBytes (what a contiguous accelerator tensor gets)."""
    items = [HfTensor(n, check_tensor(n, t), tuple(t.shape), DeviceBytes(t)) for n, t in tensors.items()]
    files = memory_source(plan_checkpoint(items).files())
    return run(Solo(), store, RankWork(files), PushOptions.of(None, cache_dir=cache, **kw))  # type: ignore[arg-type]


def test_reads_are_private_host_copies_of_the_range():
    t = torch.arange(1000, dtype=torch.int16)
    data = DeviceBytes(t)
    assert data.nbytes == 2000 and data.device == "cpu"
    got = data.read(10, 30)
    assert got.dtype == np.uint8 and got.tobytes() == t.numpy().tobytes()[10:40]
    got[:] = 0  # a copy: the tensor is untouched
    assert t[5].item() == 5
    assert data.read(2000, 0).size == 0
    buf = np.zeros(64, np.uint8)
    into = data.read(100, 40, buf)  # into a reused buffer: a view of its first 40 bytes
    assert np.shares_memory(into, buf) and into.size == 40 and into.tobytes() == t.numpy().tobytes()[100:140]
    for start, size in ((-1, 2), (1999, 2), (0, 2001)):
        with pytest.raises(ValueError, match="outside a tensor of 2000 bytes"):
            data.read(start, size)


def test_a_contiguous_tensor_off_the_host_is_read_lazily():
    # The meta device is the one non-CPU device every torch build has (push_tensors refuses it: no data).
    lazy = tensor_bytes(torch.empty(8, 4, dtype=torch.bfloat16, device="meta"))
    assert isinstance(lazy, DeviceBytes) and (lazy.nbytes, lazy.device) == (64, "meta")


def test_host_tensors_keep_the_zero_copy_path():
    t = torch.randn(64, 8)
    got = tensor_bytes(t)
    assert isinstance(got, np.ndarray) and np.shares_memory(got, t.numpy())
    strided = tensor_bytes(t.t())  # not contiguous: copied a range at a time when read (StridedBytes)
    assert not isinstance(strided, np.ndarray)
    assert strided.read(0, strided.nbytes).tobytes() == t.t().contiguous().numpy().tobytes()


def test_a_push_read_through_device_bytes_stores_the_same_versions(tmp_path, monkeypatch):
    reads: list[tuple[int, bool]] = []
    real_read = DeviceBytes.read_against

    def spy(self, start, size, out, base, versions):  # type: ignore[no-untyped-def]
        reads.append((size, out is not None))
        return real_read(self, start, size, out, base, versions)

    monkeypatch.setattr(DeviceBytes, "read_against", spy)
    plain, lazy = str(tmp_path / "plain"), str(tmp_path / "lazy")
    for store in (plain, lazy):
        Repository.open(store, create=True, chunk_bytes=512 << 10)  # several chunks per large tensor
    for step in range(3):
        w = _weights(step)
        a = push_tensors(plain, w, cache_dir=str(tmp_path / "c1"))
        b = _push_as_device(lazy, w, str(tmp_path / "c2"))
        assert a.kind == b.kind  # type: ignore[attr-defined]
        ma, mb = Repository.open(plain).manifest(step + 1), Repository.open(lazy).manifest(step + 1)
        assert [f.to_json() for f in ma.files] == [f.to_json() for f in mb.files]
    assert b.kind == "delta"  # type: ignore[attr-defined]
    # Chunks over 256 KiB (those of "big": 2 x 512 KiB and 491,424 bytes) went into the encoder's recycled
    # buffers, the tiny tensors' into fresh arrays.
    assert {size for size, into in reads if into} == {512 << 10, 1100 * 700 * 2 - (1 << 20)}
    assert {size for size, into in reads if not into} and all(size <= 256 << 10 for size, into in reads if not into)
    pull(lazy, str(tmp_path / "dest"))
    got = load_file(str(tmp_path / "dest" / "model.safetensors"))
    want = _weights(2)
    assert set(got) == set(want) and all(torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8))
                                         for n in want if want[n].numel())


def test_a_file_written_from_device_bytes_is_the_same_file(tmp_path, monkeypatch):
    import deltafs.publish.hf as hf

    monkeypatch.setattr(hf, "_WRITE_BLOCK", 1000)  # several blocks per tensor
    w = _weights(1)
    items = [HfTensor(n, check_tensor(n, t), tuple(t.shape), DeviceBytes(t)) for n, t in w.items()]
    write_files(plan_checkpoint(items).files(), str(tmp_path / "lazy"))
    write_files(plan_checkpoint(w).files(), str(tmp_path / "plain"))
    assert os.listdir(tmp_path / "lazy") == ["model.safetensors"]
    assert (tmp_path / "lazy" / "model.safetensors").read_bytes() == (tmp_path / "plain" / "model.safetensors").read_bytes()
    # Plain buffers as pieces, as before DeviceBytes existed.
    write_files({"a.bin": [(0, b"hel"), (3, memoryview(b"lo")), (5, np.frombuffer(b"!", np.uint8))]}, str(tmp_path))
    assert (tmp_path / "a.bin").read_bytes() == b"hello!"


def test_a_meta_tensor_is_refused_before_the_store_is_touched(tmp_path):
    from deltafs.errors import UsageError

    with pytest.raises(UsageError, match="w is on the meta device: it has no data to push"):
        push_tensors(str(tmp_path / "store"), {"w": torch.empty(4, 4, device="meta")}, cache_dir=str(tmp_path / "c"))
    assert not (tmp_path / "store").exists()


def test_waiting_for_devices_skips_what_has_no_queue():
    from deltafs.publish.hf import wait_for_devices

    wait_for_devices(set())
    wait_for_devices({"meta"})  # torch.accelerator.synchronize would raise "Accelerator expected" here
