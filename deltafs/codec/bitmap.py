"""Rank and select over a bit mask, vectorized: which class an element is in and its index within that class.

The sparse codec splits a chunk's elements into two classes by their base value and numbers changes within each
class. Both directions must cost about one pass over the chunk: the mask is packed into 64-bit words (bit j of
word i is element 64 i + j), a prefix sum over the words' popcounts gives rank at word granularity, and small
lookup tables finish the job inside a word for just the changed elements. The compiled loops
(deltafs/codec/_native.c: classes, partition, select) keep the same words and counts and give the same answers.
"""

from __future__ import annotations

import numpy as np

from deltafs.codec import native

_POP8 = np.array([i.bit_count() for i in range(256)], dtype=np.uint8)
# _SELECT8[b, k]: position of the k-th (0-based) set bit of byte b, 8 if b has fewer set bits.
_SELECT8 = np.full((256, 9), 8, dtype=np.uint8)
for _b in range(256):
    for _k, _pos in enumerate(p for p in range(8) if _b >> p & 1):
        _SELECT8[_b, _k] = _pos

_BYTE_SHIFTS = np.arange(0, 64, 8, dtype=np.uint64)


def _popcount64(words: np.ndarray) -> np.ndarray:
    counts: np.ndarray
    if hasattr(np, "bitwise_count"):  # numpy >= 2.0
        counts = np.bitwise_count(words).astype(np.int64)
    else:
        counts = _POP8[words.view(np.uint8)].reshape(-1, 8).sum(axis=1, dtype=np.int64)
    return counts


class RankIndex:
    """Ranks of set (class 1) and clear (class 0) bits of a length-n mask."""

    def __init__(self, mask: np.ndarray) -> None:
        packed = np.packbits(mask, bitorder="little")
        pad = (-packed.size) % 8
        if pad:
            packed = np.concatenate([packed, np.zeros(pad, np.uint8)])
        words = packed.view("<u8")
        counts = _popcount64(words)
        before = np.zeros(counts.size + 1, dtype=np.int64)  # set bits in words [0, i)
        np.cumsum(counts, out=before[1:])
        self._set(words, before, int(mask.size))

    @classmethod
    def of_words(cls, words: np.ndarray, before: np.ndarray, n: int) -> RankIndex:
        """An index over words and counts made elsewhere (the compiled classes()): bit j of words[i] is element
        64 i + j, padding bits past n clear; before[i] is the set bits in words [0, i), one entry more."""
        index = cls.__new__(cls)
        index._set(words, before, n)
        return index

    def _set(self, words: np.ndarray, before: np.ndarray, n: int) -> None:
        self.n = n
        self.words = words
        self.before = before
        self.ones = int(before[-1])
        self.zeros = n - self.ones

    def rank(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For ascending element indices: (bit is set, rank within its own class)."""
        w = idx >> 6
        bit = (idx & 63).astype(np.uint64)
        word = self.words[w]
        is_set = ((word >> bit) & np.uint64(1)).astype(bool)
        below = _popcount64(word & ((np.uint64(1) << bit) - np.uint64(1)))
        ones_before = self.before[w] + below
        return is_set, np.where(is_set, ones_before, idx - ones_before)

    def partition(self, idx: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """For ascending element indices and a value per index: (ranks of the set-bit ones within their class, their
        values, the same for the clear-bit ones), each in idx's order. Compiled: one pass over the indices."""
        c = native.loops()
        if c is not None:
            m = idx.size
            set_r, clear_r = np.empty(m, np.int64), np.empty(m, np.int64)
            set_v, clear_v = np.empty(m, values.dtype), np.empty(m, values.dtype)
            ns = c.partition(self.words, self.before, self.n, np.ascontiguousarray(idx, np.int64),
                             np.ascontiguousarray(values), values.dtype.itemsize, set_r, set_v, clear_r, clear_v)
            return set_r[:ns], set_v[:ns], clear_r[:m - ns], clear_v[:m - ns]
        is_set, ranks = self.rank(idx)
        # flatnonzero + take: boolean-mask indexing of randomly interleaved classes is ~10x slower.
        on, off = is_set.nonzero()[0], (~is_set).nonzero()[0]
        return ranks.take(on), values.take(on), ranks.take(off), values.take(off)

    def select(self, ranks: np.ndarray, bit: int) -> np.ndarray:
        """Element index of each rank-th set (bit=1) or clear (bit=0) bit; ranks must be < that class's size."""
        c = native.loops()
        if c is not None:  # one merge of the ranks with the words' counts when they ascend (a decoder's do)
            found = np.empty(ranks.size, np.int64)
            if c.select(self.words, self.before, self.n, np.ascontiguousarray(ranks, np.int64), bit, found):
                raise ValueError(f"select: a rank is not below the class's {self.ones if bit else self.zeros} elements")
            return found
        if bit:
            before, words = self.before, self.words
        else:
            # Clear bits before word i: 64 i minus the set ones. Padding bits past n read as clear, but they all
            # come after the real elements, so ranks below self.zeros never reach them.
            before = np.arange(self.before.size, dtype=np.int64) * 64 - self.before
            words = ~self.words
        w = np.searchsorted(before, ranks, side="right") - 1
        k = (ranks - before[w]).astype(np.uint64)  # rank within the word, 0..63
        where: np.ndarray = w * 64 + _select_in_word(words[w], k)
        return where


_M1, _M2, _M4 = np.uint64(0x5555555555555555), np.uint64(0x3333333333333333), np.uint64(0x0F0F0F0F0F0F0F0F)
_ONES8, _HIGH8 = np.uint64(0x0101010101010101), np.uint64(0x8080808080808080)
_U = [np.uint64(i) for i in range(9)]


def _select_in_word(x: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Position of the k-th set bit of each word (broadword select: a fixed ~20 vector ops per call, no loops)."""
    # Per-byte popcounts, then their running sums in every byte (multiplying by 0x0101... adds all lower bytes).
    s = x - ((x >> _U[1]) & _M1)
    s = (s & _M2) + ((s >> _U[2]) & _M2)
    s = (s + (s >> _U[4])) & _M4
    cum = s * _ONES8
    # Bytes whose running count is <= k lie wholly before the wanted bit; count them (all values < 128).
    byte = _popcount64(((k * _ONES8) | _HIGH8) - cum & _HIGH8).astype(np.uint64)
    shift = byte * _U[8]
    prev = ((cum << _U[8]) >> shift) & np.uint64(0xFF)  # set bits in the bytes before that one
    value = (x >> shift) & np.uint64(0xFF)
    pos: np.ndarray = (shift + _SELECT8[value, k - prev]).astype(np.int64)
    return pos
