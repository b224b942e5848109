"""Byte-level building blocks shared by the codecs: streams stored raw or as bounded zstd frames, the payload
trailer, byte planes and Rice-coded gaps. Every function here is pure and vectorized numpy (speed matters: chunks are up to 4 MiB).
"""

from __future__ import annotations

import math
import struct
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import xxhash
import zstandard

from deltafs.codec import native
from deltafs.errors import IntegrityError

T = TypeVar("T")

# Little-endian unsigned integer dtype for each element width the codecs know.
UINT: dict[int, np.dtype[Any]] = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
# Bytes: what chunks are passed around as (compared with `==`, cheaper than np.uint8 each time).
U8: np.dtype[Any] = np.dtype(np.uint8)

# zstd contexts are not thread-safe and cost ~100 us to build, so each thread keeps its own (a cache, not state:
# results never depend on it).
_local = threading.local()


def compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's zstd compressor for level (what compress() and pack() use)."""
    cache: dict[int, zstandard.ZstdCompressor] | None = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    if level not in cache:
        # Content size: decoders refuse frames that lie about their size before allocating. No frame checksum:
        # the payload trailer (seal) covers every stream at once.
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx: zstandard.ZstdDecompressor | None = getattr(_local, "decompressor", None)
    if dctx is None:
        dctx = _local.decompressor = zstandard.ZstdDecompressor()
    return dctx


def scratch(name: str, size: int, dtype: np.dtype[Any] | type) -> np.ndarray:
    """A per-thread reusable buffer for chunk-sized temporaries.

    Fresh multi-MB arrays cost page faults on every call (about as much as the arithmetic itself); reusing one
    buffer per thread keeps those passes at memory speed. Callers must not let the buffer escape.
    """
    bufs: dict[str, np.ndarray] | None = getattr(_local, "scratch", None)
    if bufs is None:
        bufs = _local.scratch = {}
    dt = np.dtype(dtype)
    buf = bufs.get(name)
    if buf is None or buf.nbytes < size * dt.itemsize:
        buf = bufs[name] = np.empty(max(size * dt.itemsize, 1 << 20), dtype=np.uint8)
    return buf[: size * dt.itemsize].view(dt)


# Below this many bytes a fresh array costs less than the per-thread lookup of scratch() (no page faults to save).
SCRATCH_FROM = 64 << 10


def temporary(name: str, nbytes: int, dtype: np.dtype[Any]) -> np.ndarray:
    """nbytes as a dtype array: scratch(name, ...) when large, a fresh array when small (same contract)."""
    if nbytes < SCRATCH_FROM:
        return np.empty(nbytes // dtype.itemsize, dtype)
    return scratch(name, nbytes // dtype.itemsize, dtype)


def compress(data: Any, level: int) -> bytes:
    """One zstd frame holding data, with its content size in the frame header."""
    return compressor(level).compress(data)


def pack(data: np.ndarray | bytes, level: int) -> bytes:
    """A stream as stored: one zstd frame when that is smaller, else the bytes themselves (empty stays empty).

    The decoder tells the two apart by length alone: a stream is raw exactly when its stored length equals its
    decoded length, so no flag is needed and incompressible streams (Rice bits, signs) cost nothing extra.
    """
    if isinstance(data, np.ndarray):
        size = data.nbytes
        if not data.flags.c_contiguous:  # zstd needs one buffer (a strided view: the sign bits of a class)
            data = np.ascontiguousarray(data)
    else:
        size = len(data)
    if not size:
        return b""
    frame = compress(data, level)  # zstd reads the array's buffer; no copy unless the frame is not smaller
    if len(frame) < size:
        return frame
    return data.tobytes() if isinstance(data, np.ndarray) else bytes(data)


def unpack(stored: bytes | memoryview, size: int, what: str) -> np.ndarray:
    """Exactly size bytes from a stream stored by pack(), or IntegrityError; never allocates more than size."""
    if len(stored) == size:
        return np.frombuffer(stored, dtype=np.uint8)
    return decompress(stored, size, what)


def decompress(frame: bytes | memoryview, size: int, what: str) -> np.ndarray:
    """Exactly size bytes from one zstd frame, or IntegrityError; never allocates more than size bytes."""
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"{what}: not a zstd frame ({exc})") from None
    # A frame whose header promises more than the manifest declares is refused before any allocation (zstd bombs).
    if declared not in (-1, size):
        raise IntegrityError(f"{what}: zstd frame declares the wrong size", expected=size, actual=declared)
    try:
        # max_output_size bounds frames that do not declare their size; declared ones were checked above.
        out = _decompressor().decompress(frame, max_output_size=max(size, 1), allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"{what}: does not decompress ({exc})") from None
    if len(out) != size:
        raise IntegrityError(f"{what}: decompressed to the wrong size", expected=size, actual=len(out))
    return np.frombuffer(out, dtype=np.uint8)


# Every stored payload ends with the XXH3-64 (seed 0, little-endian) of the bytes before it. The store already
# names objects by their sha256; this makes the codec fail closed on its own (tests, other callers, bugs): a damaged
# payload raises instead of decoding to different bytes.
TRAILER = 8
_PUT_U64 = struct.Struct("<Q").pack_into
# The trailer's function, as an integer of the bytes it covers (the compiled gamma writer calls it too).
digest = xxhash.xxh3_64_intdigest
_GET_U64 = struct.Struct("<Q").unpack_from


def seal(parts: list[Any]) -> bytes:
    """The parts (bytes-like) joined, with the trailer."""
    body = b"".join(parts)
    return body + xxhash.xxh3_64_digest(body)[::-1]  # the little-endian digest (trail() says why reversed)


def trail(payload: bytearray) -> None:
    """seal() in place: payload's last TRAILER bytes become the checksum of the bytes before them."""
    end = len(payload) - TRAILER
    _PUT_U64(payload, end, digest(memoryview(payload)[:end]))  # little-endian, as seal()


def unseal(payload: bytes | memoryview, what: str) -> memoryview:
    """The payload without its trailer, after checking it."""
    view = memoryview(payload)
    if len(view) < TRAILER:
        raise IntegrityError(f"{what}: payload of {len(view)} bytes is too short")
    end = len(view) - TRAILER
    body = view[:end]
    if digest(body) != _GET_U64(view, end)[0]:
        raise IntegrityError(f"{what}: payload checksum does not match")
    return body


def to_planes(data: np.ndarray, width: int) -> np.ndarray:
    """Split width-byte little-endian elements into width byte planes, lowest byte plane first (a transpose)."""
    if width == 1:
        return data
    return np.ascontiguousarray(data.reshape(-1, width).T).reshape(-1)


# From this many elements, from_planes copies plane by plane (see there); below, one call costs less than width.
_PLANE_BY_PLANE_FROM = 512


def from_planes(planes: np.ndarray, width: int, out: np.ndarray | None = None) -> np.ndarray:
    """Inverse of to_planes; into out (uint8, planes' size) when given, with no other temporary."""
    if width == 1:
        if out is None:
            return planes
        np.copyto(out, planes)
        return out
    target = np.empty(planes.size, np.uint8) if out is None else out
    cols, rows = target.reshape(-1, width), planes.reshape(width, -1)
    if rows.shape[1] < _PLANE_BY_PLANE_FROM:
        np.copyto(cols, rows.T)
    else:
        # One strided copy per plane: numpy runs a transposed copy with the short (width) axis innermost, a
        # loop of a few bytes per element; per plane the inner loop is the whole plane. 4 MiB of bf16: 1.8 ms
        # against 13 ms (benchmarks/codec_ab.py, docs/profile.md round 11).
        for j in range(width):
            cols[:, j] = rows[j]
    return target


# --- Rice-coded gaps ---------------------------------------------------------------------------------------------
# A gap g (a non-negative integer) with parameter k is split into q = g >> k and r = g mod 2^k. The q's go to a
# "unary" bit stream (q zero bits, then a one bit, per gap) and the r's to a "remainder" bit stream (k bits each,
# most significant first). Keeping the two apart makes both directions vectorizable: the decoder finds every gap
# boundary at once as the positions of the one bits. For geometric gaps (independent changes) the optimal k costs
# within ~0.05 bit per gap of their entropy, better than byte planes + Huffman.

MAX_RICE_K = 32


def rice_cost(gaps: np.ndarray, k: int) -> int:
    """Total bits of both streams for parameter k."""
    return int(gaps.size * (k + 1) + int((gaps >> k).sum()))


def best_rice_k(gaps: np.ndarray, total: int | None = None) -> int:
    """The k that minimises the coded size (the cost is convex in k, so walk downhill from the mean's estimate).

    total: the sum of the gaps when the caller knows it (the sparse codec does: it is the unchanged elements).
    """
    return best_rice_k_and_quotients(gaps, total)[0]


def best_rice_k_and_quotients(gaps: np.ndarray, total: int | None = None) -> tuple[int, np.ndarray]:
    """(best k, gaps >> k): the quotients are needed again to encode, so they are kept, not recomputed."""
    k, (_, q) = _walk_k(gaps.size, _first_k(gaps, total), lambda j: _quotients(gaps, j))
    return k, q


def _first_k(gaps: np.ndarray, total: int | None) -> int:
    """Where the walk starts: the k the gaps' mean suggests."""
    count = gaps.size
    if total is None:
        total = int(gaps.sum()) if count else 0
    mean = total / count if count else 0.0
    # math.log2 is the C library's log2, which the compiled group encoder calls too (the same k, the same bytes).
    return max(0, min(MAX_RICE_K, int(math.log2(mean * 0.69 + 1.0))))


def _quotients(gaps: np.ndarray, k: int) -> tuple[int, np.ndarray]:
    q = gaps >> k
    return int(q.sum()), q


def _walk_k(count: int, k: int, quotients: Callable[[int], tuple[int, T]]) -> tuple[int, tuple[int, T]]:
    """(k, quotients(k)) for the k of least cost count * (k + 1) + quotient total, walking down from the start,
    then up; quotients(k) returns (that total, whatever the caller keeps for the k it settles on)."""
    best = quotients(k)
    cost = count * (k + 1) + best[0]
    for step in (-1, 1):
        while 0 <= k + step <= MAX_RICE_K:
            nxt = quotients(k + step)
            c = count * (k + step + 1) + nxt[0]
            if c >= cost:
                break
            k, cost, best = k + step, c, nxt
    return k, best


def rice_streams(gaps: np.ndarray, total: int | None = None) -> tuple[int, np.ndarray, np.ndarray]:
    """(k, unary stream, remainder stream): the gaps Rice-coded with the k that codes them smallest (total: their
    sum, when the caller knows it). The numpy form of what the compiled group encoder does (native.group)."""
    k, q = best_rice_k_and_quotients(gaps, total)
    return (k, *rice_encode(gaps, k, q))


def rice_encode(gaps: np.ndarray, k: int, q: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(unary stream, remainder stream) as packed uint8 arrays, bits most significant first, zero-padded.

    q: gaps >> k, when the caller has it."""
    if q is None:
        q = gaps >> k
    ones = q.cumsum()  # bit index of each gap's terminating one bit: sum of (q + 1) so far, minus one
    ones += np.arange(ones.size)
    unary = np.zeros(int(ones[-1]) + 1 if ones.size else 0, dtype=np.uint8)
    unary[ones] = 1
    if k == 0:
        return np.packbits(unary), np.empty(0, np.uint8)
    return np.packbits(unary), pack_fields(gaps & ((1 << k) - 1), k)


def gaps_of(ranks: np.ndarray, end: int | None) -> np.ndarray:
    """Elements skipped before each of the ascending ranks (counting from -1), plus the gap up to the sentinel
    rank end when given: np.diff(ranks, prepend=-1, append=end) - 1 in fewer, cheaper calls."""
    c = ranks.size
    gaps = np.empty(c + (end is not None), np.int64)
    if c:
        gaps[0] = ranks[0]
        np.subtract(ranks[1:], ranks[:-1], out=gaps[1:c])
        gaps[1:c] -= 1
    if end is not None:
        gaps[c] = end - 1 - (int(ranks[-1]) if c else -1)
    return gaps


def rice_positions(unary: np.ndarray, remainder: np.ndarray, count: int, k: int, end: int, what: str) -> np.ndarray:
    """The count positions (int64) that the Rice-coded gaps lead to: position i is the sum of gaps 0..i plus i,
    i.e. np.cumsum(gaps + 1) - 1. IntegrityError unless both streams hold exactly count codes and zero padding,
    and every position is below end.

    The positions come straight from the bit stream, without the gaps as an array: the i-th one bit of the
    unary stream sits at (q_0 + ... + q_i) + i, so position i is ((ones_i - i) << k) + (r_0 + ... + r_i) + i.
    The totals are checked in Python integers before any shift, so hostile streams cannot overflow int64 as
    long as end <= 2**62 and k <= 32 (the codec's end is at most a chunk's element count plus one).
    """
    if end > 1 << 62 or not 0 <= k <= MAX_RICE_K:
        raise ValueError(f"rice_positions: end {end} or k {k} out of the supported range")
    c = native.loops()
    if c is not None and count > 0:
        fast = _native_positions(c, unary, remainder, count, k, end)
        if fast is not None:
            return fast
    ones = np.unpackbits(unary).view(np.bool_).nonzero()[0]  # nonzero on bool is ~10x faster than on uint8
    if ones.size != count:
        raise IntegrityError(f"{what}: gap stream holds the wrong number of gaps", expected=count, actual=ones.size)
    pad = (-count * k) % 8  # zero bits after the last field
    if remainder.size != (count * k + 7) // 8 or (pad and int(remainder[-1]) & ((1 << pad) - 1)):
        raise IntegrityError(f"{what}: remainder stream has the wrong size or padding")
    if not count:
        return ones.astype(np.int64, copy=False)
    last = int(ones[-1])
    if unary.size != (last >> 3) + 1:
        raise IntegrityError(f"{what}: gap stream has trailing bytes")
    # The last position is at least (sum of quotients << k) + count - 1; the remainders add less than count << k,
    # which must fit an int64.
    if ((last - (count - 1)) << k) + count - 1 >= end or count << k >= 1 << 62:
        raise IntegrityError(f"{what}: gap out of range")
    pos: np.ndarray = ones.astype(np.int64, copy=False)
    if k == 0:
        return pos
    steps = np.arange(count, dtype=np.int64)
    pos = np.subtract(pos, steps)  # quotients so far
    pos <<= k
    pos += np.cumsum(unpack_fields(remainder, count, k))
    pos += steps
    if int(pos[-1]) >= end:
        raise IntegrityError(f"{what}: gap out of range")
    return pos


def _native_positions(c: Any, unary: np.ndarray, remainder: np.ndarray, count: int, k: int, end: int) -> np.ndarray | None:
    """rice_positions through the compiled loop, or None if the streams fail any check (the numpy code then
    decodes them again and says what is wrong, so both paths refuse with the same message)."""
    pad = (-count * k) % 8
    if (end < 1 or count << k >= 1 << 62 or remainder.size != (count * k + 7) // 8
            or (pad and int(remainder[-1]) & ((1 << pad) - 1))):
        return None
    pos = np.empty(count, np.int64)
    return pos if c.positions(unary, remainder, count, k, end, pos) == 0 else None


# Fixed-width bit fields, most significant bit first. For k <= 8 (mean gaps below ~350, the usual case) eight
# fields make exactly k bytes, so they are assembled in a uint64 per eight values: a handful of vector ops over
# count / 8 words instead of per-bit work. Wider fields take the general per-bit path.
_COLUMNS_FROM = 512  # groups of eight fields from which pack_fields/unpack_fields go column by column
_FIELD_SHIFTS = [np.array([k * (7 - j) for j in range(8)], dtype=np.uint64) for k in range(9)]


def pack_fields(values: np.ndarray, k: int) -> np.ndarray:
    """The low k bits of each value, concatenated MSB first, zero-padded to whole bytes."""
    count = values.size
    if k == 0 or count == 0:
        return np.empty(0, np.uint8)
    if k > 8:
        shifts = np.arange(k - 1, -1, -1, dtype=np.int64)
        return np.packbits(((values[:, None] >> shifts) & 1).astype(np.uint8).reshape(-1))
    flat = np.zeros(count + (-count) % 8, np.uint64)
    flat[:count] = values
    v = flat.reshape(-1, 8)
    if v.shape[0] < _COLUMNS_FROM:
        words = np.bitwise_or.reduce(v << _FIELD_SHIFTS[k], axis=1)
    else:
        # One column of the eight at a time: a reduce along a length-8 axis is several times slower on long
        # inputs, but 16 calls instead of 2 cost more on short ones.
        words = v[:, 0] << _FIELD_SHIFTS[k][0]
        for j in range(1, 8):
            words |= v[:, j] << _FIELD_SHIFTS[k][j]
    out: np.ndarray = words.astype(">u8").view(np.uint8).reshape(-1, 8)[:, 8 - k:].reshape(-1)
    # Contiguous: for k = 1 the reshape above is a strided view, which the compiled loops (buffer protocol)
    # refuse with a ValueError; rice_positions on an encoder's own streams hit that (a test found it).
    return np.ascontiguousarray(out[: (count * k + 7) // 8])


def unpack_fields(buf: np.ndarray, count: int, k: int) -> np.ndarray:
    """Inverse of pack_fields: count values (int64) of k bits each from buf (ceil(count * k / 8) bytes)."""
    if k == 0 or count == 0:
        return np.zeros(count, np.int64)
    if k > 8:
        field = np.unpackbits(buf)[: count * k].reshape(count, k)
        out = np.zeros(count, dtype=np.int64)
        for j in range(k):
            out <<= 1
            out |= field[:, j]
        return out
    groups = (count + 7) // 8
    flat = np.zeros(groups * k, np.uint8)
    flat[: buf.size] = buf
    full = np.zeros((groups, 8), np.uint8)
    full[:, 8 - k:] = flat.reshape(groups, k)
    words = full.view(">u8").reshape(-1).astype(np.uint64)
    mask = np.uint64((1 << k) - 1)
    # Values are below 2**8, so the uint64 results read the same as int64: a view, not a cast.
    if groups < _COLUMNS_FROM:
        small: np.ndarray = ((words[:, None] >> _FIELD_SHIFTS[k]) & mask).reshape(-1)[:count].view(np.int64)
        return small
    vals = np.empty((groups, 8), np.uint64)
    for j in range(8):  # column by column, as in pack_fields
        np.right_shift(words, _FIELD_SHIFTS[k][j], out=vals[:, j])
    vals &= mask
    result: np.ndarray = vals.reshape(-1)[:count].view(np.int64)
    return result
