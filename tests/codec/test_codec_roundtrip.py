"""encode/decode are lossless for every dtype's bit patterns, every size and every kind of change."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltafs import codec

WIDTHS = (1, 2, 4, 8)

# Values that float formats must carry bit-exactly: NaN payloads, both zeros, infinities, subnormals, extremes.
SPECIAL_F32 = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1.17e-38, 3.4e38, -3.4e38, 1.0, -1.0],
                       dtype=np.float32)
NAN_PAYLOADS_U32 = np.array([0x7FC00001, 0xFFC12345, 0x7F800001, 0xFF800001], dtype=np.uint32)


def roundtrip(new: np.ndarray, base: np.ndarray | None, itemsize: int) -> codec.Encoded:
    """Encode, pass the codec record through JSON like a manifest does, decode; assert bytes equal."""
    enc = codec.encode(new, base, itemsize)
    record = json.loads(json.dumps(enc.codec, sort_keys=True, separators=(",", ":")))
    out = codec.decode(record, enc.payload, base, new.size, itemsize)
    assert out.dtype == np.uint8 and out.shape == (new.size,)
    assert out.tobytes() == new.tobytes()
    # Into a caller's buffer, and in place over a copy of the base (what a pull does with the old bytes).
    into = np.full(new.size, 0xA5, np.uint8)
    assert codec.decode(record, enc.payload, base, new.size, itemsize, out=into) is into
    assert into.tobytes() == new.tobytes()
    if base is not None:
        inplace = np.array(base, dtype=np.uint8, copy=True)
        codec.decode(record, enc.payload, inplace, new.size, itemsize, out=inplace)
        assert inplace.tobytes() == new.tobytes()
        # In place through two different view objects of one file buffer (a pull slicing its mapped file): the
        # codec cannot tell them apart by identity, only by memory.
        buf = np.zeros(new.size + 16, np.uint8)
        buf[8:8 + new.size] = np.asarray(base, dtype=np.uint8).reshape(-1)
        codec.decode(record, enc.payload, buf[8:8 + new.size], new.size, itemsize, out=buf[8:8 + new.size])
        assert buf[8:8 + new.size].tobytes() == new.tobytes() and not buf[:8].any() and not buf[-8:].any()
    return enc


def changed_elements(new: np.ndarray, base: np.ndarray, itemsize: int) -> int:
    width = itemsize if new.size % itemsize == 0 else 1
    return int((new.reshape(-1, width) != base.reshape(-1, width)).any(axis=1).sum()) if new.size else 0


@st.composite
def chunk_pairs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray | None, int]:
    """(new, base or None, itemsize) with base equal, sparsely, densely or wholly changed, or absent."""
    itemsize = draw(st.sampled_from(WIDTHS))
    n = draw(st.sampled_from([0, 1, 2, 3, 5, 17, 64, 255, 1000, 4099]))
    odd = draw(st.integers(0, itemsize - 1)) if draw(st.booleans()) else 0  # not a whole number of elements
    size = n * itemsize + odd
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from(["floats", "bytes", "zeros"]))
    if kind == "floats":
        base = (rng.standard_normal(size // 4 + 1) * 0.02).astype(np.float32).view(np.uint8)[:size].copy()
    elif kind == "bytes":
        base = rng.integers(0, 256, size, dtype=np.uint8)
    else:
        base = np.zeros(size, np.uint8)
    mode = draw(st.sampled_from(["none", "equal", "sparse", "dense", "all", "ulp", "moved"]))
    new = base.copy()
    if mode == "none":
        return new, None, itemsize
    width = itemsize if size % itemsize == 0 else 1
    elems = size // width
    view = new.view(f"<u{width}") if elems else new
    if mode == "sparse" and elems:
        k = max(1, elems // 200)
        pos = rng.choice(elems, size=min(k, elems), replace=False)
        view[pos] ^= rng.integers(1, 255, pos.size).astype(view.dtype)
    elif mode == "dense" and elems:
        view[rng.random(elems) < 0.4] += view.dtype.type(1)
    elif mode == "moved" and elems:
        # Nearly every element a few steps up or down (an optimizer step on F32 weights): the dense codec,
        # including wrap-around at both ends of the integer range.
        steps = rng.integers(-4, 5, elems).astype(np.int64)
        view[:] = (view.astype(np.int64) + steps).astype(view.dtype)
    elif mode == "all":
        new = rng.integers(0, 256, size, dtype=np.uint8)
    elif mode == "ulp" and elems:
        # +-1 and +-big on the integer bit patterns, including wrap-around at both ends.
        pos = np.flatnonzero(rng.random(elems) < 0.05)
        big = np.iinfo(view.dtype).max
        step = rng.choice(np.array([1, 2, min(300, big), big], dtype=view.dtype), pos.size)
        view[pos] = np.where(rng.random(pos.size) < 0.5, view[pos] + step, view[pos] - step)
    return new, base, itemsize


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunk_pairs())
def test_roundtrip_any_change(case: tuple[np.ndarray, np.ndarray | None, int]) -> None:
    new, base, itemsize = case
    enc = roundtrip(new, base, itemsize)
    width = itemsize if new.size % itemsize == 0 else 1
    if base is None:
        assert enc.codec["name"] == "raw" and enc.changed == new.size // width
    else:
        assert enc.changed == changed_elements(new, base, itemsize)
        assert (enc.codec["name"] == "same") == (enc.changed == 0)
        assert (enc.payload is None) == (enc.codec["name"] == "same")


def torch_bits(dtype: torch.dtype, rng: np.random.Generator, n: int) -> np.ndarray:
    """Bytes of a tensor of dtype holding normal values plus the format's special values."""
    special = torch.from_numpy(np.concatenate([SPECIAL_F32, (rng.standard_normal(n) * 0.02).astype(np.float32)]))
    if dtype == torch.bool:
        t = special > 0
    elif dtype.is_floating_point:
        t = special.to(dtype)
    else:
        t = torch.from_numpy(rng.integers(-100, 100, special.numel())).to(dtype)
    return t.contiguous().view(torch.uint8).numpy().copy()


DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("step", ["none", "same", "ulp", "flip", "nan_payload"])
def test_dtype_bit_patterns(dtype: torch.dtype, step: str) -> None:
    rng = np.random.default_rng(7)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    base = torch_bits(dtype, rng, 3001)
    new = base.copy()
    view = new.view(f"<u{itemsize}")
    if step == "ulp":
        view[::37] += view.dtype.type(1)
        view[5::53] -= view.dtype.type(1)
    elif step == "flip":
        view[::11] ^= view.dtype.type(1 << (8 * itemsize - 1))  # sign bit: -0.0 <-> 0.0, inf <-> -inf
    elif step == "nan_payload" and itemsize == 4:
        view[: NAN_PAYLOADS_U32.size] = NAN_PAYLOADS_U32
    elif step == "nan_payload":
        view[:3] = np.iinfo(view.dtype).max  # all-ones: a NaN with a full payload in every float format
    enc = roundtrip(new, None if step == "none" else base, itemsize)
    if step == "same":
        assert enc.codec == {"name": "same"} and enc.changed == 0


def test_size_zero_and_one() -> None:
    empty = np.empty(0, np.uint8)
    assert roundtrip(empty, None, 2).changed == 0
    assert roundtrip(empty, empty, 2).codec == {"name": "same"}
    one = np.array([7], np.uint8)
    assert roundtrip(one, None, 1).changed == 1
    assert roundtrip(one, np.array([9], np.uint8), 1).changed == 1
    # An odd byte count with itemsize 2 is coded bytewise.
    assert roundtrip(np.arange(3, dtype=np.uint8), np.zeros(3, np.uint8), 2).changed == 2


def test_accepts_bytes_and_arrays_of_any_dtype() -> None:
    base = np.arange(1000, dtype=np.float32)
    new = base.copy()
    new[10] = 3.5
    a = codec.encode(new.tobytes(), base.tobytes(), 4)
    b = codec.encode(new, base, 4)  # float32 arrays are read as their bytes
    c = codec.encode(memoryview(new.view(np.uint8)), bytearray(base.tobytes()), 4)
    assert a == b == c and a.changed == 1
    out = codec.decode(a.codec, a.payload, base.tobytes(), base.nbytes, 4)
    assert out.view(np.float32)[10] == 3.5


def test_every_change_kind_is_chosen_where_it_is_cheapest() -> None:
    rng = np.random.default_rng(0)
    base = (rng.standard_normal(1 << 18) * 0.02).astype(np.float32).view(np.uint32)
    bf16 = (base >> 16).astype(np.uint16)
    sparse = bf16.copy()
    sparse[rng.choice(bf16.size, 500, replace=False)] += np.uint16(1)
    dense = bf16 ^ rng.integers(0, 4, bf16.size, dtype=np.uint16)
    unrelated = (rng.standard_normal(bf16.size) * 0.02).astype(np.float32).view(np.uint32) >> 16
    names = {
        "sparse": roundtrip(sparse.view(np.uint8), bf16.view(np.uint8), 2).codec["name"],
        "dense": roundtrip(dense.view(np.uint8), bf16.view(np.uint8), 2).codec["name"],
        "unrelated": roundtrip(unrelated.astype(np.uint16).view(np.uint8), bf16.view(np.uint8), 2).codec["name"],
    }
    assert names == {"sparse": "sparse", "dense": "xor", "unrelated": "raw"}


def test_optimizer_step_on_f32_uses_dense_and_is_smaller_than_the_alternatives() -> None:
    rng = np.random.default_rng(4)
    base = (1.0 + 0.1 * rng.standard_normal(1024)).astype(np.float32)  # a LayerNorm gain
    new = (base - 1e-4 * np.sign(rng.standard_normal(base.size))).astype(np.float32)
    enc = roundtrip(new.view(np.uint8), base.view(np.uint8), 4)
    assert enc.codec["name"] == "dense"
    nw, bw = new.view("<u4"), base.view("<u4")
    idx = np.flatnonzero(nw != bw)
    assert enc.payload is not None
    for _, other in (codec.Sparse.encode(nw, bw, idx, codec.DEFAULT_LEVEL),
                     codec.Xor.encode(new.view(np.uint8), base.view(np.uint8), 4, codec.DEFAULT_LEVEL)):
        assert len(enc.payload) <= len(other)


def test_encode_many_matches_encode() -> None:
    rng = np.random.default_rng(1)
    pairs = []
    for _ in range(6):
        base = rng.integers(0, 256, 10000, dtype=np.uint8)
        new = base.copy()
        new[rng.choice(base.size, 30, replace=False)] += 1
        pairs.append((new, base))
    pairs.append((np.ones(8, np.uint8), None))
    many = codec.encode_many(pairs, 2, threads=2)
    assert many == [codec.encode(n, b, 2) for n, b in pairs]


def test_decode_refuses_an_unusable_out_buffer() -> None:
    base = np.arange(64, dtype=np.uint8)
    enc = codec.encode(base + 1, base, 1)
    for bad in (np.zeros(63, np.uint8), np.zeros(64, np.int8), np.zeros(128, np.uint8)[::2]):
        with pytest.raises(ValueError, match="out must be"):
            codec.decode(enc.codec, enc.payload, base, 64, 1, out=bad)


def test_rejects_mismatched_base_and_bad_itemsize() -> None:
    with pytest.raises(ValueError):
        codec.encode(b"abcd", b"abc", 1)
    with pytest.raises(ValueError):
        codec.encode(b"abcd", None, 3)


def test_small_chunk_of_unrelated_values_keeps_the_smallest_codec() -> None:
    """A small, fully changed chunk is coded dense only when that is plainly a trainer step; new values unrelated
    to the old ones still get the smallest of every codec."""
    rng = np.random.default_rng(5)
    base = (rng.standard_normal(256) * 0.02).astype(np.float32)
    for new in ((rng.standard_normal(256) * 0.02).astype(np.float32), -base, base * np.float32(1e10)):
        enc = roundtrip(new.view(np.uint8), base.view(np.uint8), 4)
        n8, b8 = new.view(np.uint8), base.view(np.uint8)
        nw, bw = new.view("<u4"), base.view("<u4")
        idx = np.flatnonzero(nw != bw)
        level = codec.DEFAULT_LEVEL
        others = [codec.Sparse.encode(nw, bw, idx, level)[1], codec.Dense.encode(nw, bw, level)[1],
                  codec.Xor.encode(n8, b8, 4, level)[1], codec.Raw.encode(n8, 4, level)[1]]
        assert enc.payload is not None and len(enc.payload) == min(len(p) for p in others)
