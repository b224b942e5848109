"""Push then pull gives back every file byte for byte, for every dtype and odd shape."""

from __future__ import annotations

import hashlib
import math
import os
import struct

import numpy as np
import pytest
import torch

from deltafs.publish import push, push_tensors
from deltafs.read.pull import pull
from deltafs.maintenance.verify import verify
from deltafs.store.repo import Repository
from deltafs.testing.checkpoints import DTYPES, files_of, perturb, random_bytes, write_safetensors


def _special_floats() -> bytes:
    """NaN with payloads, -0.0, ±inf, subnormals, as f32 bit patterns."""
    bits = [0x7FC00001, 0x7F800001, 0xFFC12345, 0x80000000, 0x7F800000, 0xFF800000, 0x00000001, 0x007FFFFF, 0x3F800000]
    return struct.pack(f"<{len(bits)}I", *bits)


@pytest.mark.parametrize("chunk_bytes", [64, 4 << 20])
def test_every_dtype_and_shape_round_trips(tmp_path, chunk_bytes):
    rng = np.random.default_rng(1)
    tensors = {}
    for dtype, size in DTYPES.items():
        for shape in [(), (0,), (1,), (7,), (3, 5, 2), (129, 3)]:
            n = math.prod(shape) * size
            tensors[f"{dtype}.{'x'.join(map(str, shape)) or 'scalar'}"] = (dtype, shape, random_bytes(rng, n))
    tensors["special.f32"] = ("F32", (9,), _special_floats())
    # Packed types fill whole bytes (the safetensors loaders refuse a tensor that does not; so does push).
    tensors["packed.f4"] = ("F4", (3, 4), random_bytes(rng, 6))  # 12 x 4 bits
    tensors["packed.f6"] = ("F6_E2M3", (2, 4), random_bytes(rng, 6))  # 8 x 6 bits
    store = str(tmp_path / "store")
    Repository.open(store, create=True, chunk_bytes=chunk_bytes)
    src = tmp_path / "v1"
    write_safetensors(str(src / "model.safetensors"), tensors, metadata={"format": "pt"}, pad_header=5)
    push(store, str(src))
    v2 = tmp_path / "v2"
    changed = {n: (d, s, perturb(b, DTYPES.get(d, 1), 0.3, rng)) for n, (d, s, b) in tensors.items()}
    write_safetensors(str(v2 / "model.safetensors"), changed, metadata={"format": "pt"}, pad_header=5)
    res = push(store, str(v2))
    assert res.kind == "delta"
    dest = tmp_path / "dest"
    pull(store, str(dest), version=1)
    assert files_of(dest) == files_of(src)
    pull(store, str(dest))
    assert files_of(dest) == files_of(v2)
    assert verify(store, all_versions=True).ok


def test_sharded_directory_with_aux_files_is_byte_identical(tmp_path, maker):
    maker.shards = 3
    store = str(tmp_path / "store")
    dest = tmp_path / "dest"
    for _ in range(3):
        src = maker.write()
        push(store, src)
        res = pull(store, str(dest))
        assert files_of(dest) == files_of(src)
        for rel, data in files_of(src).items():
            assert hashlib.sha256((dest / rel).read_bytes()).hexdigest() == hashlib.sha256(data).hexdigest()
        maker.advance()
    assert res.previous == 2 and not res.from_full
    assert sorted(files_of(dest)) == sorted(["config.json", "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                                              "model-00003-of-00003.safetensors", "model.safetensors.index.json", "tokenizer/tokenizer.json"])


def test_single_safetensors_file_source(tmp_path, maker):
    src = maker.write()
    store = str(tmp_path / "store")
    push(store, os.path.join(src, "model.safetensors"))
    pull(store, str(tmp_path / "dest"))
    assert (tmp_path / "dest" / "model.safetensors").read_bytes() == open(os.path.join(src, "model.safetensors"), "rb").read()


def test_push_tensors_from_python(tmp_path):
    torch.manual_seed(0)
    base = torch.randn(64, 32)
    tensors = {
        "w.bf16": torch.randn(33, 17).to(torch.bfloat16),
        "w.noncontig": base.t(),  # a transposed view: not contiguous
        "w.tied": base,
        "w.tied_again": base,  # shares storage with w.tied
        "w.f8": torch.randn(10).to(torch.float8_e4m3fn),
        "w.scalar": torch.tensor(-0.0),
        "w.empty": torch.zeros(0, 3, dtype=torch.int32),
    }
    store = str(tmp_path / "store")
    res = push_tensors(store, tensors, extra_files={"config.json": b'{"a": 1}'}, metadata={"step": 7})
    assert res.version == 1 and res.metadata == {"step": 7}
    pull(store, str(tmp_path / "dest"))
    from safetensors.torch import load_file

    loaded = load_file(str(tmp_path / "dest" / "model.safetensors"))
    for name, t in tensors.items():
        assert torch.equal(loaded[name].reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8)), name
    assert str(loaded["w.scalar"].item()) == "-0.0"
    assert (tmp_path / "dest" / "config.json").read_bytes() == b'{"a": 1}'


def test_push_tensors_shards_deterministically(tmp_path):
    tensors = {f"layer.{i}": torch.full((256,), float(i)) for i in range(8)}
    store = str(tmp_path / "store")
    push_tensors(store, tensors, max_shard_bytes=3000)
    tensors["layer.3"][0] = 42.0
    res = push_tensors(store, tensors, max_shard_bytes=3000)
    assert res.kind == "delta" and res.changed_fraction == pytest.approx(1 / (8 * 256))
    pull(store, str(tmp_path / "dest"))
    names = sorted(os.listdir(tmp_path / "dest"))
    assert "model.safetensors.index.json" in names and len([n for n in names if n.endswith(".safetensors")]) == 4


def test_memory_store_round_trip(tmp_path, maker):
    store = f"memory://deltafs-test-{os.getpid()}-{id(maker)}"
    dest = tmp_path / "dest"
    for _ in range(4):
        src = maker.write()
        push(store, src)
        pull(store, str(dest))
        assert files_of(dest) == files_of(src)
        maker.advance()
    assert verify(store, all_versions=True).ok


def test_delta_is_much_smaller_than_full(tmp_path, maker):
    store = str(tmp_path / "store")
    full = push(store, maker.write())
    maker.advance()
    delta = push(store, maker.write())
    assert delta.kind == "delta"
    assert delta.bytes_written * 5 < full.bytes_written
    assert 0.001 < delta.changed_fraction < 0.05
