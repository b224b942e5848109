"""Lossless per-chunk encodings against a base chunk. Pure functions over bytes; no I/O.

encode() picks, per chunk: same (nothing changed), sparse (changed positions and bit-pattern differences), dense
or gamma (every element's difference), xor (dense XOR delta) or raw (no base), from cheap statistics of the changes. decode() inverts any of them from the codec record
alone. The exact byte layouts are specified in manifests/FORMAT.md, "Chunk encodings".
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from deltafs.codec import compare, gamma, native, streams
from deltafs.codec.codecs import Dense, Raw, Same, Sparse, Xor, choose_split, dense_planes
from deltafs.codec.gamma import WIDTHS as GAMMA_WIDTHS, Counts, Gamma, count
from deltafs.defaults import DEFAULT_LEVEL
from deltafs.codec.registry import Codec, from_json, register, registered
from deltafs.errors import FormatError, IntegrityError

__all__ = [
    "DEFAULT_LEVEL",
    "SPLIT_LEVEL",
    "Codec",
    "Dense",
    "Encoded",
    "Gamma",
    "Raw",
    "Same",
    "Sparse",
    "Xor",
    "decode",
    "encode",
    "encode_many",
    "from_json",
    "register",
    "registered",
]

# Below this fraction of changed elements sparse always wins (measured on bf16 trainer deltas: 0.52x the size of
# xor at 11% changed, 0.78x even at 66%), so nothing else is tried. Above it, changes that look like small
# arithmetic steps (compare.looks_like_update, from a sample) go to sparse, or to dense from DENSE_FROM on; only
# chunks that fail that test are trial-encoded with every codec (xor or raw win when the new values are
# unrelated to the old ones).
SPARSE_ONLY_BELOW = 0.10
# dense against sparse, measured: on the trained data set's F32 tensors (90-100% changed) dense is 1.2-1.6% smaller
# in total (30% of tensors slightly larger); below ~90% changed sparse wins (at 50%: dense 1.24x the bytes).
DENSE_FROM = 0.9
# Chunks up to this many bytes take a shortcut with fewer numpy calls (each costs about a microsecond).
SMALL_CHUNK = 64 << 10
# Small chunks with at least this fraction changed (and below DENSE_FROM) are encoded both dense and sparse, and the
# smaller is kept: on the trained data set's 256-element F32 LayerNorm weights at 75-90% changed, dense is 0.57-0.70x
# the sparse payload (sparse's fixed costs per stream dominate tiny chunks); dense costs one zstd call here.
SMALL_DENSE_TRY = 0.5
# Small chunks (width 2 or 4) of at least this many elements are compared first (compiled, level < SPLIT_LEVEL): one
# pass that costs about a twentieth of gamma's counts over the same chunk, and encodes the chunk outright when at
# most SPARSE_ONLY_BELOW of it changed (a bf16 chunk of a trainer step), which the counts would only have counted.
# Smaller chunks (F32 norms and biases, mostly changed) go to the counts directly.
SMALL_COMPARE_FIRST = 8192
# From this level on, sparse chunks may split elements into two classes by base magnitude (see choose_split): on
# bf16 trainer deltas about 18% smaller, but each encode and decode pays a pass over the base chunk plus a rank or
# a select per change: on the trained set's bf16 chunks 1.35-1.6x the encode and 1.75-1.9x the decode time of
# level 3; whole pushes 1.0-1.3x, pulls 1.2-1.35x (docs/profile.md, round 19). Below it the codec is faster than
# XOR + zstd-1.
SPLIT_LEVEL = 5
# Small chunks >= DENSE_FROM changed are encoded dense directly when the payload is at most this fraction of the
# chunk: (width - 1) / width, the size test that matches looks_like_update's "well below the element width".
DENSE_TRUSTED = {2: 0.5, 4: 0.75, 8: 0.875}
_SAME = {"name": "same"}
# The share of elements repeating the previous element's difference from which dense is tried beside gamma
# (trainer steps on F32 norms and biases: under 5%; a few distinct steps such as ±1 ulp: 30% and more).
REPEATS_TRY_DENSE = 0.125
# The share of gamma's payload that coding the 3 bits below each leading one by their frequencies would save
# (Counts.skew) from which dense is tried beside gamma. Bits close to uniform (AdamW steps on the trained data set's
# F32 norms and biases) estimate 0.2-15%, median 1-2%: the trial runs on 1-24% of those tensors and dense was the
# smaller on one, by 4 bytes; a relative step of fixed size (benchmarks/small_tensors.py's data) 1.3-31%, where
# dense is the smaller on 69% of the tensors (gamma alone: 1.2x dense's bytes) and every one of those reaches 4%.
# docs/benchmarks.md, "Round 21".
SKEW_TRY_DENSE = 0.04


class Encoded(NamedTuple):
    """One encoded chunk: its codec record (JSON-able), the stored payload, and what changed. (A named tuple, not a
    frozen dataclass: one is made per chunk, and the dataclass took ~1 us of a small F32 tensor's ~12 us.)"""

    codec: dict[str, Any]
    payload: bytes | None
    changed: int  # elements that differ from the base (all of them when there is no base)


def _as_u8(buf: Any) -> np.ndarray:
    if type(buf) is np.ndarray and buf.dtype == streams.U8 and buf.ndim == 1 and buf.flags.c_contiguous:
        return buf  # the usual case, a chunk of a file's bytes: no wrapper calls
    if isinstance(buf, np.ndarray):
        return np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)


def _width(size: int, itemsize: int) -> int:
    # Header and blob segments (and packed sub-byte dtypes) come with itemsize 1; a size that is not a whole
    # number of elements can only be such bytes, so it is coded bytewise.
    if itemsize not in (1, 2, 4, 8):
        raise ValueError(f"itemsize must be 1, 2, 4 or 8, got {itemsize}")
    return itemsize if size % itemsize == 0 else 1


def encode(new: Any, base: Any | None, itemsize: int, *, level: int = DEFAULT_LEVEL,
           known: tuple[np.ndarray, np.ndarray] | None = None, full_level: int | None = None) -> Encoded:
    """Encode new (bytes-like or uint8 array) against base (same length) or against nothing.

    level is the zstd level of every stream; from SPLIT_LEVEL on it also enables the magnitude-class split.
    full_level, when given, is the zstd level of a chunk encoded against nothing (`raw`) instead of level.
    known: (ascending element indices, new values) that include every element where new differs from base, when
    the caller found them already (a device-side diff); saves the compare over the chunk. Indices where the values
    equal the base are dropped here, and the payload is the one encode() would write without them. Not checked: a
    `known` that misses a changed element gives a payload that does not decode to new (the caller must know, as
    deltafs.publish.device_diff does: its new is the base with exactly these elements written).
    """
    n = _as_u8(new)
    width = _width(n.size, itemsize)
    small_dense: tuple[Codec, bytes] | None = None
    counts: Counts | None = None  # gamma's counts, once made (a small chunk that goes on to the general path)
    if base is None:
        raw, raw_payload = Raw.encode(n, width, level if full_level is None else full_level)
        return Encoded(raw.to_json(), raw_payload, n.size // width)
    b = _as_u8(base)
    if b.size != n.size:
        raise ValueError(f"base chunk has {b.size} bytes, new chunk {n.size}")
    small = n.size <= SMALL_CHUNK and width > 1
    found = None  # (idx, nv, bv) of the compiled compare, when made early (below)
    if small and width in GAMMA_WIDTHS:
        if (n.size >= SMALL_COMPARE_FIRST * width and known is None and level < SPLIT_LEVEL
                and (c := native.loops()) is not None):
            # A sparse small chunk (few changes: gamma's counts below would only say how many) costs one compiled
            # call, as a large one does; otherwise the compare's result is kept for the general path.
            found, grouped = compare.changes_or_group(c, n, b, width, SPARSE_ONLY_BELOW)
            if grouped is not None:
                return _sparse_grouped(grouped, width, level)
            assert found is not None
            if not found[0].size:
                return Encoded(dict(_SAME), None, 0)
        # Small chunks (biases, norms) are dominated by per-call costs: one pass over the differences answers
        # "what changed" and, when most elements moved (an optimizer step on F32), sizes the gamma codec and
        # writes its payload where it is a candidate below.
        counts, written = gamma.count_and_write(n, b, width, _ALONE[width])
        if written is not None and counts.changed >= DENSE_FROM * (n.size // width):
            # The usual small F32 step: gamma alone (_gamma_alone), within DENSE_TRUSTED.
            return Encoded(gamma.record(width, counts.plan), written, counts.changed)
    dtype = streams.UINT[width]
    nw, bw = n.view(dtype), b.view(dtype)
    if small:
        d = planes = None
        if counts is not None:
            changed = counts.changed
        elif native.loops() is not None:  # one compiled pass counts the changes and makes the dense stream
            changed, planes = dense_planes(nw, bw)
        else:
            d = np.subtract(nw, bw)
            changed = int(np.count_nonzero(d))
        if changed == 0:
            return Encoded(dict(_SAME), None, 0)
        if changed >= SMALL_DENSE_TRY * nw.size:
            # Encoding outright is cheaper than the sampled statistic (looks_like_update costs as much as the
            # encode here). The size answers the same question: small arithmetic steps leave at least one byte
            # per element near zero, so a payload within DENSE_TRUSTED of the chunk is a trainer step; a larger
            # one (unrelated values, bit flips) goes on to the general path, which tries every codec.
            step: tuple[Codec, bytes] | None
            if counts is not None:
                # The smaller of gamma and dense. Gamma alone within DENSE_TRUSTED was written above, and so was a
                # chunk below DENSE_FROM changed (where gamma usually wins: every one on the trained set); gamma
                # alone over it is left to the general path below. From DENSE_FROM on, a chunk that fails the
                # alone test is where dense often wins (a relative step of fixed size: 69% of
                # benchmarks/small_tensors.py's), so its gamma is written only if it wins.
                step = None if _gamma_alone(counts, nw.size) else _difference(nw, bw, level, counts, written)
            else:
                step = Dense.encode(nw, bw, level, diff=d, planes=planes)
            if step is not None and len(step[1]) <= DENSE_TRUSTED[width] * n.size:
                if changed >= DENSE_FROM * nw.size:
                    return Encoded(step[0].to_json(), step[1], changed)
                small_dense = step  # a trainer step: below, the smaller of it and sparse
    if (known is not None and known[0].size <= nw.size and known[1].size == known[0].size
            and known[1].dtype.itemsize == width):
        idx, nv = known
        bv = bw[idx]
        moved = nv.view(dtype) != bv
        if not moved.all():
            idx, nv, bv = idx[moved], nv[moved], bv[moved]
        nv = nv.view(dtype)
    elif found is not None:
        idx, nv, bv = found
    elif small_dense is not None and level < SPLIT_LEVEL and (c := native.loops()) is not None:
        # A small chunk at least SMALL_DENSE_TRY changed, with a trainer step's dense or gamma payload in hand: the
        # smaller of it and sparse (sparse on a tie), sparse's streams from the compare in the same compiled call.
        # The sparse encode stops once it cannot be the smaller, usually after its first zstd call.
        grouped = compare.changes_or_group(c, n, b, width, 1.0)[1]
        assert grouped is not None  # some changed, and a small chunk's every element fits the outputs
        sparse_json = Sparse.encode_grouped(grouped, width, level, len(small_dense[1]))
        if sparse_json is not None:
            return Encoded(*sparse_json, grouped[0])
        return Encoded(small_dense[0].to_json(), small_dense[1], grouped[0])
    else:
        # One vectorized compare + nonzero over the chunk is the main cost of a sparse delta. Compiled, and where
        # no split is possible, the streams of a chunk under SPARSE_ONLY_BELOW changed come from the same call.
        c = native.loops()
        if c is not None and level < SPLIT_LEVEL:
            found, grouped = compare.changes_or_group(c, n, b, width, SPARSE_ONLY_BELOW)
            if grouped is not None:  # what Sparse.encode below makes of them, in fewer calls
                return _sparse_grouped(grouped, width, level)
            assert found is not None
            idx, nv, bv = found
        else:
            idx, nv, bv = compare.changes(n, b, width)
    changed = int(idx.size)
    if changed == 0:
        return Encoded(dict(_SAME), None, 0)
    fraction = changed / nw.size
    split = choose_split(bw, idx) if level >= SPLIT_LEVEL else 0
    rec: Codec
    payload: bytes
    if fraction <= SPARSE_ONLY_BELOW:
        rec, payload = Sparse.encode(nw, bw, idx, level, split, values=(nv, bv))
    elif small_dense is not None:
        # The smaller of sparse and the dense payload in hand (sparse on a tie); the sparse encode stops once it
        # cannot be the smaller, which on such chunks is usually after its first zstd call.
        sparse = Sparse.encode_within(nw, bw, idx, level, len(small_dense[1]), split, values=(nv, bv))
        rec, payload = small_dense if sparse is None else sparse
    elif compare.looks_like_update(nv, bv):
        # Small arithmetic steps (a trainer's): a difference codec wins, which one is set by the density.
        if fraction >= DENSE_FROM:
            if width in GAMMA_WIDTHS:
                rec, payload = _difference(nw, bw, level, counts if counts is not None else count(nw, bw))
            else:
                rec, payload = Dense.encode(nw, bw, level)
        else:
            rec, payload = Sparse.encode(nw, bw, idx, level, split, values=(nv, bv))
    else:
        # Unrelated values or bit flips: rare, so every codec is tried and the smallest kept.
        candidates: list[tuple[Codec, bytes]] = [Sparse.encode(nw, bw, idx, level, split, values=(nv, bv)),
                                                 Dense.encode(nw, bw, level), Xor.encode(n, b, width, level),
                                                 Raw.encode(n, width, level)]
        if width in GAMMA_WIDTHS:
            candidates.append(Gamma.encode(nw, bw))
        rec, payload = min(candidates, key=lambda c: len(c[1]))
    return Encoded(rec.to_json(), payload, changed)


def _difference(nw: np.ndarray, bw: np.ndarray, level: int, counts: Counts, written: bytes | None = None
                ) -> tuple[Codec, bytes]:
    """The chunk as gamma, or as dense where that may be smaller and is. written: gamma's payload, when the
    counting call wrote it (gamma.count_and_write).

    Gamma's size is known exactly from the counts; dense's only by running zstd, which beats the bit lengths on
    differences that repeat (a constant shift; a first step from zeros, where Adam moves every element by the same
    ±lr) and, by up to ~3%, on chunks with 10-50% of elements unchanged (zero runs). So dense is tried only where
    at least REPEATS_TRY_DENSE of the elements repeat the previous element's difference, fewer than DENSE_FROM
    changed, or the bits below the leading ones are far from uniform (Counts.skew at least SKEW_TRY_DENSE of
    gamma's payload: steps that cluster within their bit length, such as a relative step of fixed size). On the
    trained data set's small F32 tensors that is 1-24% of them, dense is the smaller on one (by 4 bytes), and gamma
    is 0.84x dense's bytes.
    """
    plan = counts.plan
    if not _gamma_alone(counts, nw.size):
        dense = Dense.encode(nw, bw, level)
        if plan.payload >= len(dense[1]):
            return dense
    if written is None:
        return Gamma.encode(nw, bw, plan)
    return Gamma(nw.dtype.itemsize, plan.center, plan.rice, plan.unary), written


def _sparse_grouped(grouped: tuple[Any, ...], width: int, level: int) -> Encoded:
    """The chunk changes_or_group returned sparse streams for, encoded (Sparse.encode_grouped, no limit)."""
    encoded = Sparse.encode_grouped(grouped, width, level)
    assert encoded is not None  # no limit: always encoded
    return Encoded(encoded[0], encoded[1], grouped[0])


def _gamma_alone(counts: Counts, elements: int) -> bool:
    """Whether _difference writes gamma without trying dense (its docstring says when)."""
    return gamma.passes(counts, elements, _GAMMA_ALONE)


# _gamma_alone's test; per width of a small chunk, with DENSE_TRUSTED's limit on the payload: the test
# gamma.count_and_write applies, so a small chunk that passes it is written in the counting call.
_GAMMA_ALONE = gamma.Alone(DENSE_FROM, float("inf"), REPEATS_TRY_DENSE, SKEW_TRY_DENSE, SMALL_DENSE_TRY)
_ALONE = {w: _GAMMA_ALONE._replace(payload_within=DENSE_TRUSTED[w]) for w in GAMMA_WIDTHS if w in DENSE_TRUSTED}


def decode(codec: dict[str, Any], payload: bytes | None, base: Any | None, size: int, itemsize: int, *,
           out: np.ndarray | None = None) -> np.ndarray:
    """The chunk's bytes as a uint8 array of exactly size bytes.

    FormatError for an unknown or malformed codec record, IntegrityError for a payload that does not decode to
    exactly what the record declares. itemsize is the segment's; the record's own width is what decodes.

    out: a writable, contiguous uint8 array of size bytes to decode into (returned), instead of a new array. It
    may be base itself: a sparse chunk then costs only its changes, no pass over the chunk. Every codec checks
    its payload before writing to out, so a damaged payload raises and leaves an in-place base as it was.
    """
    if type(size) is not int:
        try:
            size = operator.index(size)
        except TypeError:
            raise FormatError(f"chunk size must be an integer, got {size!r}") from None
    if size < 0:
        raise FormatError(f"chunk size must be non-negative, got {size}")
    rec = from_json(codec)
    b = None if base is None else _as_u8(base)
    if out is not None:
        flags = out.flags if isinstance(out, np.ndarray) else None
        if not (flags is not None and out.dtype == streams.U8 and out.ndim == 1 and out.size == size
                and flags.c_contiguous and flags.writeable):
            raise ValueError(f"out must be a writable contiguous 1-D uint8 array of {size} bytes")
        if out is base:
            b = out
    try:
        out = rec.decode(payload, b, size, out)
    except (ValueError, IndexError, OverflowError) as exc:
        if isinstance(exc, (FormatError, IntegrityError)):
            raise
        # Belt and braces: any numpy complaint about hostile input is an integrity problem, not a crash.
        raise IntegrityError(f"{rec.name} chunk does not decode: {exc}") from None
    if out.size != size:
        raise IntegrityError(f"{rec.name} chunk decoded to the wrong size", expected=size, actual=out.size)
    return out


def encode_many(
    pairs: Iterable[tuple[Any, Any | None]], itemsize: int, *, level: int = DEFAULT_LEVEL, threads: int = 2
) -> list[Encoded]:
    """encode() over many (new, base) chunks with a thread pool; numpy and zstd release the GIL for the heavy parts."""
    items: Sequence[tuple[Any, Any | None]] = list(pairs)
    if threads <= 1 or len(items) <= 1:
        return [encode(n, b, itemsize, level=level) for n, b in items]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(lambda nb: encode(nb[0], nb[1], itemsize, level=level), items))
