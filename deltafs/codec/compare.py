"""Finding what changed between a chunk and its base, and cheap statistics that pick the codec without trial
encodes. Vectorized numpy throughout: this pass touches every byte of the chunk.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from deltafs.codec import native, streams

_WORD = np.dtype("<u8")


def changes(n: np.ndarray, b: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ascending indices, new values, base values) of the width-byte elements where n and b (uint8) differ.

    `.nonzero()[0]` rather than np.flatnonzero: same result, without ~10 us of wrapper per call on tiny chunks.
    Compares 8-byte words first, so the full-chunk passes (compare, nonzero) run over a quarter of the elements
    for bf16; only the changed words are split into lanes. Values come back as streams.UINT[width].
    """
    dtype = streams.UINT[width]
    c = native.loops()
    if c is not None:
        return _compiled_changes(c, n, b, width, dtype)
    lanes = 8 // width
    words = n.size // 8
    if lanes == 1 or words == 0:
        nw, bw = n.view(dtype), b.view(dtype)
        idx = (np.not_equal(nw, bw, out=streams.scratch("ne", nw.size, np.bool_))).nonzero()[0]
        return idx, nw[idx], bw[idx]
    wn, wb = n[: words * 8].view(_WORD), b[: words * 8].view(_WORD)
    hit = (np.not_equal(wn, wb, out=streams.scratch("ne", words, np.bool_))).nonzero()[0]
    gn, gb = wn[hit].view(dtype), wb[hit].view(dtype)  # the changed words as lanes, word-major
    lane = (gn != gb).nonzero()[0]
    shift = lanes.bit_length() - 1
    idx = (hit << shift)[lane >> shift]  # the shift on the (fewer) changed words, not on every change
    idx |= lane & (lanes - 1)
    nv, bv = gn[lane], gb[lane]
    if words * 8 < n.size:  # a tail shorter than a word: element by element
        tn, tb = n[words * 8:].view(dtype), b[words * 8:].view(dtype)
        tail = (tn != tb).nonzero()[0]
        if tail.size:
            idx = np.concatenate([idx, tail + words * lanes])
            nv, bv = np.concatenate([nv, tn[tail]]), np.concatenate([bv, tb[tail]])
    return idx, nv, bv


def _compiled_changes(c: Any, n: np.ndarray, b: np.ndarray, width: int,
                      dtype: np.dtype[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """changes() in one compiled pass (see _outputs and _fitted)."""
    out = _outputs(n.size // width, dtype)
    return _fitted(c, n, b, width, out, c.changes(n, b, width, *out, native.simd_level))


_ROOM = 1 << 16


def _outputs(elements: int, dtype: np.dtype[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Room for the compiled compare's first try: 1/16 of the elements (all of a small chunk); an unused np.empty
    costs no memory until written."""
    room = elements if elements <= _ROOM else max(_ROOM, elements >> 4)
    return np.empty(room, np.int64), np.empty(room, dtype), np.empty(room, dtype)


def _fitted(c: Any, n: np.ndarray, b: np.ndarray, width: int, out: tuple[np.ndarray, np.ndarray, np.ndarray],
            count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The count changes the compiled compare found into out, compared again into room for all of them where more
    changed than out holds."""
    idx, nv, bv = out
    if count > idx.size:
        idx, nv, bv = np.empty(count, np.int64), np.empty(count, nv.dtype), np.empty(count, bv.dtype)
        c.changes(n, b, width, idx, nv, bv, native.simd_level)
    return idx[:count], nv[:count], bv[:count]


def changes_or_group(c: Any, n: np.ndarray, b: np.ndarray, width: int, below: float
                     ) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray] | None, tuple[Any, ...] | None]:
    """(changes(n, b, width), None), or (None, the sparse streams of those changes) where at least one element and
    at most a fraction `below` of them changed: the compiled compare and group (native.changes_group) in one call,
    for a chunk without split. The streams: (count, k, unary, remainder, signs, big, big_k, big_unary,
    big_remainder, plane 0, ..., plane width - 1), as native.group gives them for the class of every element."""
    out = _outputs(n.size // width, streams.UINT[width])
    got = c.changes_group(n, b, width, *out, native.simd_level, below)
    if type(got) is tuple:
        return None, got
    return _fitted(c, n, b, width, out, got), None

_SIGNED: dict[int, np.dtype[Any]] = {1: np.dtype("<i1"), 2: np.dtype("<i2"), 4: np.dtype("<i4"), 8: np.dtype("<i8")}
# Shift counts as numpy scalars of each width's dtype: a Python int operand costs a type resolution per call.
_ONE = {w: streams.UINT[w].type(1) for w in streams.UINT}
_TOP = {w: _SIGNED[w].type(8 * w - 1) for w in streams.UINT}


def zigzag(d: np.ndarray) -> np.ndarray:
    """Wrapped differences (unsigned) as zigzag integers: 0, -1, 1, -2 ... -> 0, 1, 2, 3 ... (same dtype)."""
    # The arithmetic shift of the signed view is -1 for negative differences, 0 otherwise: three numpy calls.
    w = d.dtype.itemsize
    out: np.ndarray = np.left_shift(d, _ONE[w])
    out ^= np.right_shift(d.view(_SIGNED[w]), _TOP[w]).view(d.dtype)
    return out


def unzigzag(z: np.ndarray, sign: np.ndarray | None = None) -> np.ndarray:
    """zigzag's inverse, in place on z (unsigned, writable), which is returned: (z >> 1) XOR -(z & 1). sign: a
    scratch array of z's shape and dtype for the low bits, where the caller keeps one."""
    one = _ONE[z.dtype.itemsize]
    low = np.bitwise_and(z, one, out=sign)
    z >>= one
    z ^= np.negative(low, out=low)
    return z


def _mean_bits(v: np.ndarray) -> float:
    """Mean bit length of unsigned integers (0 for 0); float64's exponent is exact enough for a statistic."""
    return float(np.frexp(v.astype(np.float64))[1].mean())


SAMPLE = 512


def looks_like_update(nv: np.ndarray, bv: np.ndarray) -> bool:
    """Whether the changed elements look like small arithmetic updates of the base, from a sample of them.

    True when their differences' zigzag bit length is on average no longer than the XOR's (so the difference
    codecs beat xor) and well below the element width (so the values are related, and raw cannot win). A
    trainer's step is tiny next to the weights: a few ulps, 1-3 bits. New values unrelated to the base, or
    bit flips rather than arithmetic changes, fail the test, and then the caller tries every codec.
    """
    step = max(1, nv.size // SAMPLE)
    n, b = nv[::step], bv[::step]
    zz_bits = _mean_bits(zigzag(n - b))
    return zz_bits <= _mean_bits(n ^ b) and zz_bits <= nv.dtype.itemsize * 8 - 8

