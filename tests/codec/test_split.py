"""The sparse codec's class split (level 5): the compiled classes, partition, select and choose_split against the
numpy code they replace, on the edges (widths, lengths off a word, extreme thresholds) and on refusals."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltafs import codec
from deltafs.codec import codecs, native, streams
from deltafs.codec.bitmap import RankIndex

built = pytest.mark.skipif(not native.BUILT, reason="deltafs.codec._native was not built (no C compiler)")


def _both(fn: Callable[[], Any]) -> tuple[Any, Any]:
    """fn() with the compiled loops, then with numpy."""
    try:
        native.enabled = True
        compiled = fn()
        native.enabled = False
        plain = fn()
    finally:
        native.enabled = native.BUILT
    return compiled, plain


def _trainer_like(rng: np.random.Generator, n: int, width: int, rate: float) -> tuple[np.ndarray, np.ndarray]:
    """A float base with weights over many exponents and a step that changes small weights far more often (by
    +-1..3 ulp), as an optimizer does: (new, base) as width-byte unsigned ints."""
    if width == 2:
        base = (rng.standard_normal(n).astype(np.float32) * 0.02).view(np.uint32) >> 16
        base = base.astype(np.uint16)
    else:
        base = (rng.standard_normal(n) * 0.02).astype(np.float32).view(np.uint32)
    dtype = streams.UINT[width]
    magnitude = base & dtype.type((1 << (8 * width - 1)) - 1)
    # Elements below the exponent of the median magnitude (about a third of them) change 30x as often.
    shift = 8 * width - 1 - codecs.SPLIT_BITS
    edge = (int(np.median(magnitude)) >> shift) << shift
    p = np.where(magnitude < edge, 3 * rate, 0.1 * rate)
    moved = rng.random(n) < p
    step = rng.choice(np.array([1, 2, 3, -1, -2, -3], np.int64), n).astype(dtype)
    new = base.copy()
    new[moved] += step[moved]
    return new, base


@built
@settings(max_examples=200, deadline=None)
@given(width=st.sampled_from([1, 2, 4, 8]), n=st.sampled_from([1, 63, 64, 65, 127, 1000, 4097]),
       split_q=st.sampled_from([0.0, 1e-9, 0.3, 0.999, 1.0]), seed=st.integers(0, 2**32 - 1))
def test_classes_rank_and_select_match_numpy(width: int, n: int, split_q: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    dtype = streams.UINT[width]
    bw = rng.integers(0, 2 ** (8 * width), n, dtype=np.uint64).astype(dtype)
    top = (1 << (8 * width - 1)) - 1
    split = min(top, int(split_q * top))  # float rounding may pass the top
    compiled, plain = _both(lambda: codecs.split_index(bw, split))
    assert np.array_equal(compiled.words, plain.words) and np.array_equal(compiled.before, plain.before)
    assert (compiled.ones, compiled.zeros) == (plain.ones, plain.zeros)
    low = (bw & dtype.type(top)) < dtype.type(split) if split else np.zeros(n, bool)
    assert compiled.ones == int(low.sum())
    idx = np.unique(rng.integers(0, n, max(1, n // 3)))
    is_set, ranks = plain.rank(idx)
    assert np.array_equal(is_set, low[idx])
    for bit in (1, 0):
        want = idx[is_set == bool(bit)]
        mine = ranks[is_set == bool(bit)]
        shuffled = rng.permutation(mine.size)  # out of order: the compiled walk falls back to a binary search
        for order in (np.arange(mine.size), shuffled):
            got = _both(lambda r=mine[order], b=bit: compiled.select(r, b))
            assert np.array_equal(got[0], want[order]) and np.array_equal(got[1], want[order])


@built
def test_select_and_partition_refuse_what_is_out_of_range() -> None:
    assert native.module is not None
    bw = np.arange(1000, dtype=np.uint16)
    index = codecs.split_index(bw, 300)
    assert (index.ones, index.zeros) == (300, 700)
    assert np.array_equal(index.select(np.array([299]), 1), [299])
    assert np.array_equal(index.select(np.array([699]), 0), [999])
    native.enabled = True
    for ranks, bit in (([300], 1), ([700], 0), ([-1], 0), ([5, 700], 0)):
        with pytest.raises(ValueError, match="not below the class"):
            index.select(np.array(ranks), bit)
    m = native.module
    out = np.empty(1, np.int64)
    d = np.zeros(1, np.uint16)
    for bad in (-1, 1000):
        with pytest.raises(ValueError, match="outside the chunk"):
            m.partition(index.words, index.before, 1000, np.array([bad]), d, 2, out, d.copy(), out.copy(), d.copy())
    with pytest.raises(ValueError, match="sized"):
        m.partition(index.words, index.before, 1100, np.array([1]), d, 2, out, d.copy(), out.copy(), d.copy())
    with pytest.raises(ValueError, match="split within"):  # above the largest bf16 magnitude
        m.classes(bw.view(np.uint8), 2, 1 << 15, np.empty(16, np.uint64), np.empty(17, np.int64))
    with pytest.raises(ValueError, match="sized alike"):
        m.classes(bw.view(np.uint8), 2, 5, np.empty(15, np.uint64), np.empty(17, np.int64))
    with pytest.raises(ValueError, match="outside the chunk"):
        m.choose_split(bw.view(np.uint8), 2, 1, np.array([0, 1000]), 1, 7, 0.93)


@built
@settings(max_examples=120, deadline=None)
@given(width=st.sampled_from([2, 4]), n=st.sampled_from([4096, 5000, 70_000]),
       rate=st.sampled_from([0.001, 0.01, 0.05, 0.3]), seed=st.integers(0, 2**32 - 1),
       trainer=st.booleans())
def test_choose_split_and_partition_match_numpy(width: int, n: int, rate: float, seed: int, trainer: bool) -> None:
    """Both paths choose the same threshold (the same floating-point steps) and put each change in the same class
    at the same rank, so level 5 writes the same bytes either way."""
    rng = np.random.default_rng(seed)
    if trainer:
        nw, bw = _trainer_like(rng, n, width, rate)
    else:  # no relation between magnitude and change: splitting rarely pays
        dtype = streams.UINT[width]
        bw = rng.integers(0, 2 ** (8 * width), n, dtype=np.uint64).astype(dtype)
        nw = bw.copy()
        moved = rng.random(n) < rate
        nw[moved] += dtype.type(1)
    idx = np.flatnonzero(nw != bw)
    compiled, plain = _both(lambda: codecs.choose_split(bw, idx))
    assert compiled == plain
    shift = max(0, 8 * width - 1 - codecs.SPLIT_BITS)
    assert compiled % (1 << shift) == 0 and 0 <= compiled < 1 << (8 * width - 1)
    if trainer and idx.size >= 1000:
        assert compiled > 0  # small weights change far more often here: two classes pay
    if idx.size:
        encoded = _both(lambda: codec.encode(nw.view(np.uint8), bw.view(np.uint8), width, level=codec.SPLIT_LEVEL))
        assert encoded[0] == encoded[1]
        back = codec.decode(encoded[0].codec, encoded[0].payload, bw.view(np.uint8), nw.nbytes, width)
        assert back.tobytes() == nw.tobytes()


def test_choose_split_needs_enough_elements_and_changes() -> None:
    rng = np.random.default_rng(1)
    nw, bw = _trainer_like(rng, 4095, 2, 0.05)
    assert codecs.choose_split(bw, np.flatnonzero(nw != bw)) == 0  # under 4096 elements
    nw, bw = _trainer_like(rng, 8192, 2, 0.05)
    assert codecs.choose_split(bw, np.flatnonzero(nw != bw)[:63]) == 0  # under 64 changes
    b8 = rng.integers(0, 2**63, 8192, dtype=np.uint64)
    assert codecs.choose_split(b8, np.arange(0, 8192, 3)) == 0  # width 8: never split


def test_rank_index_of_words_is_the_same_index() -> None:
    mask = np.random.default_rng(2).random(1000) < 0.3
    a = RankIndex(mask)
    b = RankIndex.of_words(a.words, a.before, a.n)
    assert (b.n, b.ones, b.zeros) == (a.n, a.ones, a.zeros)
    ranks = np.arange(0, a.zeros, 7)
    assert np.array_equal(a.select(ranks, 0), b.select(ranks, 0))


@built
def test_select_finds_every_bit_of_hand_made_words() -> None:
    """Every position of words that stress the byte-wise select: full, empty, one bit at each end, alternating,
    a single full byte at each place, for both classes."""
    patterns = [~0, 0, 1, 1 << 63, 0x5555555555555555, 0xAAAAAAAAAAAAAAAA, 0x8000000000000001]
    patterns += [0xFF << (8 * b) for b in range(8)] + [0x0101010101010101 << b for b in range(8)]
    rng = np.random.default_rng(3)
    patterns += [int(v) for v in rng.integers(0, 2**63, 20, dtype=np.uint64)]
    bits = np.array([[(p >> j) & 1 for j in range(64)] for p in patterns], bool).reshape(-1)
    index = RankIndex(bits)
    for bit in (1, 0):
        want = np.flatnonzero(bits == bool(bit))
        got = _both(lambda b=bit, n=want.size: index.select(np.arange(n), b))
        assert np.array_equal(got[0], want) and np.array_equal(got[1], want)
