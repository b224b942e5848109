"""The codec's building blocks: bit fields, Rice-coded gaps, rank/select, stored streams."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltafs.codec import streams
from deltafs.codec.bitmap import RankIndex
from deltafs.errors import IntegrityError


@settings(max_examples=200, deadline=None)
@given(k=st.integers(0, 32), values=st.lists(st.integers(0, 2**32 - 1), max_size=300))
def test_bit_fields_roundtrip_msb_first(k: int, values: list[int]) -> None:
    v = np.array(values, dtype=np.int64) & ((1 << k) - 1)
    packed = streams.pack_fields(v, k)
    assert packed.size == (v.size * k + 7) // 8
    # Same bits as the obvious per-bit construction.
    bits = "".join(format(int(x), f"0{k}b") if k else "" for x in v)
    bits += "0" * (-len(bits) % 8)
    assert packed.tobytes() == bytes(int(bits[i:i + 8], 2) for i in range(0, len(bits), 8))
    assert np.array_equal(streams.unpack_fields(packed, v.size, k), v)


@settings(max_examples=200, deadline=None)
@given(gaps=st.lists(st.integers(0, 5000), min_size=1, max_size=400))
def test_rice_roundtrip_with_the_best_parameter(gaps: list[int]) -> None:
    g = np.array(gaps, dtype=np.int64)
    k = streams.best_rice_k(g)
    assert all(streams.rice_cost(g, k) <= streams.rice_cost(g, j) for j in range(14))
    unary, remainder = streams.rice_encode(g, k)
    positions = np.cumsum(g + 1) - 1
    end = int(positions[-1]) + 1
    assert np.array_equal(streams.rice_positions(unary, remainder, g.size, k, end, "t"), positions)
    with pytest.raises(IntegrityError, match="wrong number of gaps"):
        streams.rice_positions(unary, remainder, g.size + 1, k, end, "t")
    with pytest.raises(IntegrityError, match="gap out of range"):  # the last position must be below end
        streams.rice_positions(unary, remainder, g.size, k, end - 1, "t")


@settings(max_examples=200, deadline=None)
@given(gaps=st.lists(st.integers(0, 2**20), min_size=1, max_size=50), k=st.integers(0, 32), data=st.data())
def test_rice_positions_refuse_damaged_streams(gaps: list[int], k: int, data: st.DataObject) -> None:
    """Any flipped bit is refused or decodes to other positions, never to an out-of-range or overflowed one."""
    g = np.array(gaps, dtype=np.int64)
    unary, remainder = streams.rice_encode(g, k)
    end = int((np.cumsum(g + 1) - 1)[-1]) + 1
    which = data.draw(st.sampled_from([s for s in ("unary", "remainder") if (unary if s == "unary" else remainder).size]))
    stream = (unary if which == "unary" else remainder).copy()
    bit = data.draw(st.integers(0, stream.size * 8 - 1))
    stream[bit // 8] ^= 1 << (7 - bit % 8)
    u, r = (stream, remainder) if which == "unary" else (unary, stream)
    try:
        pos = streams.rice_positions(u, r, g.size, k, end, "t")
    except IntegrityError:
        return
    assert pos.size == g.size and int(pos.min()) >= 0 and int(pos.max()) < end
    assert (np.diff(pos) >= 1).all()


def test_rice_positions_refuse_totals_that_would_overflow() -> None:
    """Quotients whose shifted total passes end are refused before any int64 shift (k = 32, a long unary run)."""
    unary = np.zeros(1 << 12, np.uint8)
    unary[-1] = 1  # one gap with a quotient of 32,767
    remainder = np.zeros(4, np.uint8)
    with pytest.raises(IntegrityError, match="gap out of range"):
        streams.rice_positions(unary, remainder, 1, 32, 1 << 40, "t")
    assert streams.rice_positions(unary, remainder, 1, 32, 1 << 48, "t").tolist() == [32767 << 32]
    with pytest.raises(ValueError):  # beyond the range its overflow checks cover: a caller's mistake
        streams.rice_positions(unary, remainder, 1, 32, (1 << 62) + 1, "t")


@settings(max_examples=100, deadline=None)
@given(bits=st.lists(st.booleans(), min_size=1, max_size=700), data=st.data())
def test_rank_and_select_invert_each_other(bits: list[bool], data: st.DataObject) -> None:
    mask = np.array(bits)
    index = RankIndex(mask)
    assert index.ones == mask.sum() and index.zeros == (~mask).sum()
    idx = np.array(sorted(data.draw(st.sets(st.integers(0, mask.size - 1), min_size=1))))
    is_set, rank = index.rank(idx)
    assert np.array_equal(is_set, mask[idx])
    for bit in (1, 0):
        sel = idx[is_set == bool(bit)]
        assert np.array_equal(index.select(rank[is_set == bool(bit)], bit), sel)


def test_streams_are_stored_raw_when_zstd_does_not_help() -> None:
    noise = np.random.default_rng(0).integers(0, 256, 1000, dtype=np.uint8)
    assert streams.pack(noise, 3) == noise.tobytes()
    zeros = np.zeros(1000, np.uint8)
    stored = streams.pack(zeros, 3)
    assert len(stored) < 100
    assert streams.unpack(stored, 1000, "t").tobytes() == zeros.tobytes()
    assert streams.pack(np.empty(0, np.uint8), 3) == b""
    with pytest.raises(IntegrityError):
        streams.unpack(stored, 999, "t")
    sealed = bytearray(streams.seal([b"abc"]))
    sealed[-1] ^= 1
    with pytest.raises(IntegrityError):
        streams.unseal(bytes(sealed), "t")
    assert bytes(streams.unseal(streams.seal([b"ab", b"c"]), "t")) == b"abc"


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("elements", [0, 1, 511, 512, 513, 5000])
def test_byte_planes_invert_with_and_without_a_target(width: int, elements: int) -> None:
    # Both of from_planes' copy paths (one transposed copy below 512 elements, plane by plane from there).
    data = np.random.default_rng(elements * 8 + width).integers(0, 256, elements * width, dtype=np.uint8)
    planes = streams.to_planes(data, width)
    # Plane j holds byte j of every element, lowest byte first.
    assert np.array_equal(planes.reshape(width, -1), data.reshape(-1, width).T)
    assert np.array_equal(streams.from_planes(planes, width), data)
    into = np.full(data.size, 0xA5, np.uint8)
    assert streams.from_planes(planes, width, out=into) is into
    assert np.array_equal(into, data)


def test_fields_come_back_contiguous_for_every_width() -> None:
    """pack_fields' output goes straight to the compiled loops, which take only contiguous buffers (k = 1 used to
    come back as a strided view, and rice_positions on it raised ValueError)."""
    gaps = np.zeros(9, np.int64)
    for k in range(0, 9):
        unary, remainder = streams.rice_encode(gaps, k)
        assert remainder.flags.c_contiguous and unary.flags.c_contiguous
        assert streams.rice_positions(unary, remainder, gaps.size, k, gaps.size + 1, "t").tolist() == list(range(9))
