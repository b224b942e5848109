"""The sparse encoder's shortcuts change no choice: a trial against dense that stops early keeps the smaller payload,
and the streams it no longer tries to compress are stored as they would have been."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from deltafs import codec
from deltafs.codec import compare, streams
from deltafs.codec.codecs import UNIFORM_TRY_FROM, Dense, Sparse
from deltafs.codec.gamma import WIDTHS as GAMMA_WIDTHS
from deltafs.codec.gamma import count as gamma_counts


def _step(rng: np.random.Generator, n: int, width: int, rate: float, spread: int) -> tuple[np.ndarray, np.ndarray]:
    """(new, base) as bytes: base random floats' bit patterns, new moved by up to +-spread units at rate."""
    dtype = streams.UINT[width]
    base = rng.integers(0, 1 << (8 * width - 2), n, dtype=np.uint64).astype(dtype)
    moved = rng.random(n) < rate
    step = rng.integers(-spread, spread + 1, n)
    step[step == 0] = 1
    new = np.where(moved, (base.astype(np.int64) + step).astype(dtype), base).astype(dtype)
    return new.view(np.uint8), base.view(np.uint8)


@settings(max_examples=150, deadline=None)
@given(width=st.sampled_from([2, 4, 8]), n=st.sampled_from([16, 256, 1000, 3072]),
       rate=st.floats(0.5, 0.95), spread=st.sampled_from([1, 3, 40, 70_000]), seed=st.integers(0, 2**32 - 1))
def test_small_chunk_trial_keeps_the_smaller_payload(width: int, n: int, rate: float, spread: int, seed: int) -> None:
    """Small chunks 50-90% changed are encoded gamma (and dense too where differences repeat, the smaller kept) and
    sparse, and the smaller kept (sparse on a tie): the same record and payload as encoding them all in full."""
    new, base = _step(np.random.default_rng(seed), n, width, rate, spread)
    dtype = streams.UINT[width]
    nw, bw = new.view(dtype), base.view(dtype)
    got = codec.encode(new, base, width)
    idx, nv, bv = compare.changes(new, base, width)
    if not idx.size:
        assert got.codec == {"name": "same"}
        return
    dense = Dense.encode(nw, bw, codec.DEFAULT_LEVEL)
    sparse = Sparse.encode(nw, bw, idx, codec.DEFAULT_LEVEL, values=(nv, bv))
    fraction = idx.size / nw.size
    trusted = len(dense[1]) <= codec.DENSE_TRUSTED[width] * new.size
    if codec.SMALL_DENSE_TRY <= fraction < codec.DENSE_FROM and trusted:
        difference = dense  # the dense-like codec: gamma where it can code the width (and dense, when tried, is
        if width in GAMMA_WIDTHS:  # no smaller)
            gamma = codec.Gamma.encode(nw, bw)
            repeats = int(np.count_nonzero(np.diff(nw - bw) == 0))
            skew = gamma_counts(nw, bw).skew
            tried = (repeats >= codec.REPEATS_TRY_DENSE * nw.size or fraction < codec.DENSE_FROM
                     or skew >= codec.SKEW_TRY_DENSE * len(gamma[1]))
            difference = gamma if not tried or len(gamma[1]) < len(dense[1]) else dense
        best = sparse if len(sparse[1]) <= len(difference[1]) else difference
        assert (got.codec, got.payload) == (best[0].to_json(), best[1])
    assert codec.decode(got.codec, got.payload, base, new.size, width).tobytes() == new.tobytes()


@settings(max_examples=150, deadline=None)
@given(width=st.sampled_from([1, 2, 4]), n=st.sampled_from([64, 500, 5000, 40_000]), rate=st.floats(0.001, 0.9),
       spread=st.sampled_from([1, 5, 300]), slack=st.integers(-40, 40), seed=st.integers(0, 2**32 - 1))
def test_a_limit_stops_only_a_larger_payload(width: int, n: int, rate: float, spread: int, slack: int,
                                             seed: int) -> None:
    """encode_within(limit) is None exactly when the full sparse payload is longer than limit, else the same."""
    new, base = _step(np.random.default_rng(seed), n, width, rate, spread)
    dtype = streams.UINT[width]
    nw, bw = new.view(dtype), base.view(dtype)
    idx, nv, bv = compare.changes(new, base, width)
    if not idx.size:
        return
    full = Sparse.encode(nw, bw, idx, codec.DEFAULT_LEVEL, values=(nv, bv))
    limit = max(0, len(full[1]) + slack)
    within = Sparse.encode_within(nw, bw, idx, codec.DEFAULT_LEVEL, limit, values=(nv, bv))
    if len(full[1]) > limit:
        assert within is None
    else:
        assert within is not None and within[0] == full[0] and within[1] == full[1]


def test_near_uniform_streams_are_tried_with_zstd_only_from_their_threshold() -> None:
    """Sign bits of all-positive steps are all zero, which zstd shrinks to a few bytes: below UNIFORM_TRY_FROM they
    are stored as they are (the cost of a zstd call, saved, is worth more than the bytes on trainer deltas), from
    it they are compressed. Positions and magnitudes are tried at every size."""
    for count, compressed in ((8 * (UNIFORM_TRY_FROM // 2), False), (8 * UNIFORM_TRY_FROM, True)):
        base = np.zeros(count, np.uint16)
        new = base + np.uint16(3)  # every element +3: signs all zero, magnitudes all 1 (stored as 3 - 2)
        idx = np.arange(count, dtype=np.int64)
        rec, payload = Sparse.encode(new, base, idx, codec.DEFAULT_LEVEL)
        signs_plain = rec.groups[0].stream_sizes(2)[2]
        assert signs_plain == count // 8
        assert (rec.frames[2] < signs_plain) is compressed
        assert rec.frames[0] < rec.groups[0].stream_sizes(2)[0]  # the unary stream of equal gaps: compressed
        out = codec.decode(rec.to_json(), payload, base.view(np.uint8), 2 * count, 2)
        assert out.tobytes() == new.tobytes()


def test_bytewise_chunks_try_every_stream() -> None:
    """Headers and other files (width 1) are not optimizer steps: their small sign stream of zeros is compressed."""
    count = 8 * (UNIFORM_TRY_FROM // 2)
    base = np.zeros(count, np.uint8)
    new = base + np.uint8(3)
    rec, payload = Sparse.encode(new, base, np.arange(count, dtype=np.int64), codec.DEFAULT_LEVEL)
    assert rec.frames[2] < rec.groups[0].stream_sizes(1)[2]
    assert codec.decode(rec.to_json(), payload, base, count, 1).tobytes() == new.tobytes()
