"""The chunk encodings: same, raw, xor, sparse, dense (gamma has its own module). Byte layouts: manifests/FORMAT.md.

Each record is a frozen dataclass holding exactly the parameters its decoder needs. Encoders take the chunk as
width-byte little-endian unsigned integers (`nw`, `bw`: new and base); decoders return the chunk as uint8.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np

from deltafs.codec import native, streams
from deltafs.codec.compare import unzigzag, zigzag
from deltafs.codec.bitmap import RankIndex
from deltafs.codec.registry import fields, int_field, register, width_field
from deltafs.errors import FormatError, IntegrityError

# Chunks are at most a few MiB; this bound keeps hostile counts from driving allocations or int64 overflow.
MAX_ELEMENTS = 1 << 40


def _need_base(name: str, base: np.ndarray | None, size: int) -> np.ndarray:
    if base is None:
        raise FormatError(f"chunk codec {name!r} needs a base chunk")
    if base.size != size:
        raise IntegrityError(f"{name}: base chunk has the wrong size", expected=size, actual=base.size)
    return base


def _need_payload(name: str, payload: bytes | None) -> bytes:
    if payload is None:
        raise FormatError(f"chunk codec {name!r} needs a stored payload")
    return payload


def _put(out: np.ndarray, chunk: np.ndarray) -> np.ndarray:
    if out is not chunk:
        np.copyto(out, chunk)
    return out


def _check_width(name: str, width: int, size: int) -> None:
    if size % width:
        raise FormatError(f"{name}: chunk of {size} bytes is not a whole number of {width}-byte elements")


@register
@dataclass(frozen=True)
class Same:
    """The chunk equals the base chunk; nothing is stored."""

    name: ClassVar[str] = "same"
    needs_base: ClassVar[bool] = True

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Same:
        fields(raw, ())
        return cls()

    def decode(self, payload: bytes | None, base: np.ndarray | None, size: int,
               out: np.ndarray | None = None) -> np.ndarray:
        if payload is not None:
            raise FormatError("chunk codec 'same' stores no payload")
        b = _need_base(self.name, base, size)
        return b if out is None else _put(out, b)


@register
@dataclass(frozen=True)
class Raw:
    """The chunk itself, split into byte planes, one stream (zstd unless incompressible); needs no base."""

    width: int
    name: ClassVar[str] = "raw"
    needs_base: ClassVar[bool] = False

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "width": self.width}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Raw:
        return cls(width_field(fields(raw, ("width",))["width"]))

    @staticmethod
    def encode(new: np.ndarray, width: int, level: int) -> tuple[Raw, bytes]:
        return Raw(width), streams.seal([streams.pack(streams.to_planes(new, width), level)])

    def decode(self, payload: bytes | None, base: np.ndarray | None, size: int,
               out: np.ndarray | None = None) -> np.ndarray:
        _check_width(self.name, self.width, size)
        body = streams.unseal(_need_payload(self.name, payload), "raw chunk")
        data = streams.unpack(body, size, "raw chunk")
        return streams.from_planes(data, self.width, out=out)


@register
@dataclass(frozen=True)
class Xor:
    """new XOR base, split into byte planes, one stream (zstd unless incompressible): the dense delta."""

    width: int
    name: ClassVar[str] = "xor"
    needs_base: ClassVar[bool] = True

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "width": self.width}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Xor:
        return cls(width_field(fields(raw, ("width",))["width"]))

    @staticmethod
    def encode(new: np.ndarray, base: np.ndarray, width: int, level: int) -> tuple[Xor, bytes]:
        return Xor(width), streams.seal([streams.pack(streams.to_planes(np.bitwise_xor(new, base), width), level)])

    def decode(self, payload: bytes | None, base: np.ndarray | None, size: int,
               out: np.ndarray | None = None) -> np.ndarray:
        _check_width(self.name, self.width, size)
        b = _need_base(self.name, base, size)
        body = streams.unseal(_need_payload(self.name, payload), "xor chunk")
        data = streams.unpack(body, size, "xor chunk")
        # The planes go back into a temporary: out may be the base, which the XOR still reads.
        delta = streams.from_planes(data, self.width, out=streams.temporary("planes", size, streams.U8))
        result: np.ndarray = np.bitwise_xor(delta, b, out=out)
        return result


def dense_planes(nw: np.ndarray, bw: np.ndarray, diff: np.ndarray | None = None) -> tuple[int, np.ndarray]:
    """(how many elements differ, the byte planes of the zigzag-coded differences nw - bw): the dense payload's
    stream before zstd. diff: nw - bw if the caller has it."""
    width = nw.dtype.itemsize
    c = native.loops()
    if c is not None:
        planes = np.empty(nw.nbytes, np.uint8)
        return c.codes(nw, bw, width, planes), planes
    d = np.subtract(nw, bw) if diff is None else diff
    codes = zigzag(d).astype(streams.UINT[width], copy=False)
    return int(np.count_nonzero(d)), streams.to_planes(codes.view(np.uint8), width)


@register
@dataclass(frozen=True)
class Dense:
    """Every element's difference against the base, zigzag-coded, split into byte planes, one stream.

    For chunks where nearly every element moved a little (F32 weights after an optimizer step): the difference
    d = new - base (mod 2^(8w), as in sparse) is stored as the zigzag integer (d << 1) XOR -(d >> (8w - 1)),
    so small steps up or down have small codes whatever their sign, and no positions or sign bits are stored.
    """

    width: int
    name: ClassVar[str] = "dense"
    needs_base: ClassVar[bool] = True

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "width": self.width}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Dense:
        return cls(width_field(fields(raw, ("width",))["width"]))

    @staticmethod
    def encode(nw: np.ndarray, bw: np.ndarray, level: int, diff: np.ndarray | None = None,
               planes: np.ndarray | None = None) -> tuple[Dense, bytes]:
        """nw, bw: new and base as width-byte little-endian unsigned ints; diff: nw - bw, or planes: the byte planes
        of its zigzag codes (dense_planes), if the caller has them."""
        width = nw.dtype.itemsize
        if planes is None:
            planes = dense_planes(nw, bw, diff)[1]
        return Dense(width), streams.seal([streams.pack(planes, level)])

    def decode(self, payload: bytes | None, base: np.ndarray | None, size: int,
               out: np.ndarray | None = None) -> np.ndarray:
        _check_width(self.name, self.width, size)
        b = _need_base(self.name, base, size)
        body = streams.unseal(_need_payload(self.name, payload), "dense chunk")
        data = streams.unpack(body, size, "dense chunk")
        width = self.width
        c = native.loops()
        target: np.ndarray
        if c is not None and (out is None or out is b or not np.may_share_memory(out, b)):
            # One C pass over planes, base and out instead of the numpy calls below (which handle any overlap).
            target = np.empty(size, np.uint8) if out is None else out
            c.dense(data, width, b, target)
            return target
        dtype = streams.UINT[width]
        # Few numpy calls: the planes are transposed into a temporary and unzigzagged there, then added to the
        # base into out. out may be the base or overlap it (numpy's ufuncs handle the overlap).
        t = streams.from_planes(data, width, out=streams.temporary("planes", size, streams.U8)).view(dtype)
        unzigzag(t, streams.temporary("sign", size, dtype))
        target = np.empty(size, np.uint8) if out is None else out
        np.add(t, b.view(dtype), out=target.view(dtype))  # wraps, inverting the encoder's subtraction
        return target


def _all_ints(values: list[Any]) -> bool:
    """Every item is exactly an int (bools and floats are not), in one C-level pass."""
    return set(map(type, values)) == {int}


@dataclass(frozen=True)
class Group:
    """The changes of one element class: their ranks within the class and their differences against the base."""

    count: int  # changed elements
    rice: int  # Rice parameter of the rank gaps
    unary: int  # decoded bytes of the unary gap stream
    big: int  # changes whose difference is not +-1
    big_rice: int  # Rice parameter of the gaps between those
    big_unary: int  # decoded bytes of their unary gap stream

    KEYS: ClassVar[tuple[str, ...]] = ("count", "rice", "unary", "big", "big_rice", "big_unary")

    def to_json(self) -> dict[str, int]:
        return {"count": self.count, "rice": self.rice, "unary": self.unary, "big": self.big, "big_rice": self.big_rice,
                "big_unary": self.big_unary}  # KEYS, spelled out: a manifest holds thousands of these

    @classmethod
    def from_json(cls, raw: Any) -> Group:
        if type(raw) is dict and raw.keys() == _GROUP_KEYS:
            # The usual, valid record, checked in a few C-level calls (a manifest holds thousands of these);
            # anything else takes the field-by-field path below, which says what is wrong.
            values = [raw[k] for k in cls.KEYS]
            if (_all_ints(values) and min(values) >= 0 and max(values) <= MAX_ELEMENTS
                    and values[1] <= streams.MAX_RICE_K and values[4] <= streams.MAX_RICE_K):
                return cls(*values)
        if not isinstance(raw, dict):
            raise FormatError(f"sparse: group must be an object, got {raw!r}")
        f = fields({"name": "sparse group", **raw}, cls.KEYS)
        return cls(
            count=int_field(f["count"], "count", 0, MAX_ELEMENTS),
            rice=int_field(f["rice"], "rice", 0, streams.MAX_RICE_K),
            unary=int_field(f["unary"], "unary", 0, MAX_ELEMENTS),
            big=int_field(f["big"], "big", 0, MAX_ELEMENTS),
            big_rice=int_field(f["big_rice"], "big_rice", 0, streams.MAX_RICE_K),
            big_unary=int_field(f["big_unary"], "big_unary", 0, MAX_ELEMENTS),
        )

    def stream_sizes(self, width: int) -> list[int]:
        """Decoded sizes of the group's 5 + width streams, in payload order."""
        return [self.unary, ((self.count + 1) * self.rice + 7) // 8, (self.count + 7) // 8,
                self.big_unary, (self.big * self.big_rice + 7) // 8] + [self.big] * width


_GROUP_KEYS = frozenset(Group.KEYS)  # dict.keys() compares equal to a set of the same keys
_SPARSE_KEYS = frozenset(("name", "width", "split", "groups", "frames"))


# Streams 1-4 of a group (Rice remainders, signs, the large changes' gaps) of numeric elements are close to uniform
# by construction: the low bits of geometric gaps and the signs of optimizer steps. zstd is tried on them only from
# this many bytes, where clustered positions (an embedding's rows) can make them compressible. Over four steps of the
# trained data set and three of the generator, zstd shrank 2 of 2,208 such streams (8,253 and 18,207 bytes, both an
# embedding's remainders) and none below 8 KiB; each attempt on a small stream costs about as much as the rest of its
# encode (docs/profile.md, round 15).
UNIFORM_TRY_FROM = 4096


def _group_streams(ranks: np.ndarray, diff: np.ndarray, space: int) -> tuple[Group, list[Any], list[bool]]:
    """One class of space elements as its 5 + width streams (rank gaps in Rice code, signs, the magnitudes that are
    not 1), not yet stored, and for each whether zstd is worth trying on it.

    Compiled, one call (native.group). In numpy, written for few calls per group (each costs about a microsecond
    however small the chunk): the Rice parameter's search starts from the known gap total, and signs and
    magnitudes come from one pass (_signs_and_big). Both give the same streams (tests/codec/test_native.py).
    """
    width = diff.dtype.itemsize
    c = native.loops()
    if c is not None:
        k, unary, remainder, signs, big, big_k, big_unary, big_remainder, planes = c.group(
            np.ascontiguousarray(ranks, np.int64), np.ascontiguousarray(diff), width, space)
        group = Group(int(ranks.size), k, len(unary), big, big_k, len(big_unary))
        view = memoryview(planes)  # one plane per slice, sharing the bytes
        found = [unary, remainder, signs, big_unary, big_remainder,
                 *(view[j * big:(j + 1) * big] for j in range(width))]
        return group, found, _worth_trying(found, width)
    count = ranks.size
    # Gaps >= 0 count the class's elements skipped since the previous change. A last gap up to the sentinel rank
    # `space` makes the stream say how big the class is, so a decoder given the wrong chunk size or base notices.
    gaps = streams.gaps_of(ranks, space)
    k, unary, remainder = streams.rice_streams(gaps, space - count)
    signs, big_at, big_values = _signs_and_big(diff)
    parts = [unary, remainder, signs]
    big_k = 0
    if big_at.size:
        big_gaps = streams.gaps_of(big_at, None)
        big_k, big_unary, big_remainder = streams.rice_streams(big_gaps, int(big_at[-1]) + 1 - big_at.size)
        planes = streams.to_planes(big_values.view(np.uint8), width).reshape(width, -1)
        parts += [big_unary, big_remainder, *planes]
    else:
        big_unary = np.empty(0, np.uint8)
        parts += [big_unary] * (2 + width)
    group = Group(int(count), k, int(unary.size), int(big_at.size), big_k, int(big_unary.size))
    arrays = [np.ascontiguousarray(p) for p in parts]
    return group, arrays, _worth_trying(arrays, width)


def _stored(parts: list[Any], tries: list[bool], level: int, limit: int | None) -> list[Any] | None:
    """A sparse chunk's streams as stored (streams.pack where tries says so, else as they are: 1-D byte arrays, bytes
    or memoryviews, so len() is their size and seal joins them without a copy each); None when the payload would
    exceed limit bytes. The raw streams count first, the others are compressed largest first, so a losing payload
    is usually known after one zstd call instead of 5 + width."""
    # streams.pack, inline (a call per stream adds up on small chunks): a frame where it is smaller, else the
    # contiguous stream as it is.
    compress = streams.compressor(level).compress
    if limit is None:
        stored = []
        for p, t in zip(parts, tries, strict=True):
            if t and len(p) and len(frame := compress(p)) < len(p):
                p = frame
            stored.append(p)
        return stored
    stored = list(parts)
    total = streams.TRAILER + sum(len(p) for p, t in zip(parts, tries, strict=True) if not t)
    for j in sorted((j for j, t in enumerate(tries) if t), key=lambda j: -len(parts[j])):
        if total > limit:
            return None
        p = parts[j]
        if len(p) and len(frame := compress(p)) < len(p):
            stored[j] = frame
        total += len(stored[j])
    return None if total > limit else stored


def _worth_trying(parts: list[Any], width: int) -> list[bool]:
    """For each of a group's streams, whether zstd is tried on it (see UNIFORM_TRY_FROM). Bytewise chunks (safetensors
    headers, other files) are not numbers stepped by an optimizer: every stream is tried there."""
    if width == 1:
        return [True] * len(parts)
    least = UNIFORM_TRY_FROM
    return [True, len(parts[1]) >= least, len(parts[2]) >= least, len(parts[3]) >= least,
            len(parts[4]) >= least] + [True] * (len(parts) - 5)


def _signs_and_big(diff: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sign bits packed MSB first, indexes of the changes whose magnitude is not 1, those magnitudes less 2 as
    little-endian integers) of wrapped differences: the numpy form of the compiled group encoder's pass."""
    width = diff.dtype.itemsize
    dtype = streams.UINT[width]
    # Sign and magnitude of the wrapped difference read as two's complement; unsigned math, so -2**(bits-1) works.
    negative = diff >= diff.dtype.type(1 << (width * 8 - 1))
    # |d| is the smaller of d and -d (wrapped); for -2**(bits-1) both are equal. A where= ufunc is ~30x slower.
    magnitude = np.minimum(diff, np.negative(diff))
    # One ulp up or down is by far the most common change; only the others are listed, as a sparse list of its own.
    big_at = (magnitude != 1).nonzero()[0]
    big_values = magnitude[big_at]
    big_values -= diff.dtype.type(2)  # magnitude 0 cannot occur; 2 and up store from 0
    # Explicitly little-endian before splitting into byte planes (arithmetic results are in native order).
    return np.packbits(negative), big_at, big_values.astype(dtype, copy=False)


@dataclass(frozen=True)
class _Changes:
    """One class's decoded, checked changes, not yet applied: where they go and the streams of their differences."""

    where: np.ndarray  # int64 element indexes (ranks until mapped through the split), ascending
    signs: np.ndarray  # one bit per change, MSB first, padding checked
    big_at: np.ndarray  # int64 indexes of the changes whose magnitude is not 1, ascending
    big: np.ndarray  # their magnitudes less 2, as width-byte little-endian integers (dtype)


def _decode_group(group: Group, parts: list[np.ndarray], space: int, dtype: np.dtype[Any]) -> _Changes:
    """The changes of one class of space elements, with every stream checked (nothing is written yet)."""
    # count + 1 gaps: the last one reaches the sentinel rank `space` (see _group_streams).
    ranks = streams.rice_positions(parts[0], parts[1], group.count + 1, group.rice, space + 1, "sparse positions")
    if int(ranks[-1]) != space:
        raise IntegrityError("sparse: positions do not span the chunk", expected=space, actual=int(ranks[-1]))
    ranks = ranks[:-1]
    count = group.count
    if count % 8 and int(parts[2][-1]) & ((1 << (8 - count % 8)) - 1):
        raise IntegrityError("sparse: sign stream has non-zero padding")
    if group.big > count:
        raise IntegrityError("sparse: more large differences than changes", expected=count, actual=group.big)
    if group.big:
        big_at = streams.rice_positions(parts[3], parts[4], group.big, group.big_rice, count, "sparse magnitudes")
        width = dtype.itemsize
        # Byte planes back into elements: each plane is one column of the little-endian values.
        planes = np.empty((group.big, width), np.uint8)
        for j in range(width):
            planes[:, j] = parts[5 + j]
        big = planes.reshape(-1).view(dtype)
    elif parts[3].size or parts[4].size:
        raise IntegrityError("sparse magnitudes: gap stream holds the wrong number of gaps", expected=0,
                             actual=int(np.unpackbits(parts[3]).sum()))
    else:
        big_at, big = _NO_INDEX, np.empty(0, dtype)
    return _Changes(ranks, parts[2], big_at, big)


_NO_INDEX = np.empty(0, np.int64)


def _differences(ch: _Changes, dtype: np.dtype[Any]) -> np.ndarray:
    """The wrapped difference of each change: +-1, or +-(big + 2) where listed."""
    count = ch.where.size
    magnitude = np.ones(count, dtype=dtype)
    if ch.big_at.size:
        values = ch.big + dtype.type(2)  # wraps like the encoder's subtraction
        magnitude[ch.big_at] = values
    # Two's complement negation where the sign bit is set, without a (slow) where= ufunc: with m = 0 or all ones,
    # (x ^ m) - m is x or -x. Wraps like the encoder.
    m = np.unpackbits(ch.signs, count=count).astype(dtype)
    m = np.negative(m, out=m)
    diff: np.ndarray = np.bitwise_xor(magnitude, m, out=magnitude)
    diff -= m
    return diff


# numpy >= 1.25 runs ufunc.at on plain integer arrays in one fast loop: 85 us against 150 us for `out[where] +=
# diff` (a gather, an add and a scatter) for the ~27,000 changes of a 4 MiB bf16 chunk (older numpy's ufunc.at is
# many times slower). It holds the GIL for the whole call where the fancy form releases it in each step; on 2 cores
# the two forms decode and pull alike (benchmarks/gil_ops.py; docs/profile.md, round 10), more threads may differ.
_ADD_AT = np.lib.NumpyVersion(np.__version__) >= "1.25.0"


def _scatter_add(out: np.ndarray, where: np.ndarray, diff: np.ndarray) -> None:
    """out[where] += diff (wrapping) for distinct positions."""
    if _ADD_AT:
        np.add.at(out, where, diff)
    else:
        out[where] += diff


def _apply(ow: np.ndarray, ch: _Changes) -> None:
    """ow[where] += difference for each change (wrapping; the positions are distinct and checked)."""
    c = native.loops()
    if c is None:
        _scatter_add(ow, ch.where, _differences(ch, ow.dtype))
        return
    # One C pass: the differences are formed and added element by element, no temporaries.
    where = np.ascontiguousarray(ch.where, np.int64)
    status = c.apply(ow.view(np.uint8), ow.dtype.itemsize, where, ch.signs, ch.big_at, ch.big.view(np.uint8))
    if status:  # the decoder checked all of this already: a caller's bug, not a damaged payload
        raise ValueError(f"sparse: compiled apply refused its input (status {status})")


def _split_mask(bw: np.ndarray, split: int) -> np.ndarray:
    """Elements whose base magnitude (all bits but the top one, the sign of a float) is below split."""
    mask = bw.dtype.type((1 << (bw.dtype.itemsize * 8 - 1)) - 1)
    # Two passes over the chunk; for floats this puts small weights, whose ulp is small and which change far more
    # often, in a class of their own. Scratch buffers: the result is consumed (packed) before the next call.
    tmp = np.bitwise_and(bw, mask, out=streams.scratch("split", bw.size, bw.dtype))
    low: np.ndarray = np.less(tmp, bw.dtype.type(split), out=streams.scratch("split_mask", bw.size, np.bool_))
    return low


def split_index(bw: np.ndarray, split: int) -> RankIndex:
    """The chunk's two classes (low: base magnitude below split) as a rank/select index: one compiled pass over the
    base, or _split_mask and numpy's packing."""
    c = native.loops()
    if c is None:
        return RankIndex(_split_mask(bw, split))
    nw = (bw.size + 63) // 64
    words, before = np.empty(nw, np.uint64), np.empty(nw + 1, np.int64)
    c.classes(bw.view(np.uint8), bw.dtype.itemsize, split, words, before)
    return RankIndex.of_words(words, before, int(bw.size))


# choose_split's candidates: thresholds at the magnitudes whose top SPLIT_BITS bits are a power of two apart; for
# floats of widths 2 and 4 that is every exponent (for bytes, every value). On trainer deltas (bf16, 0.77-4.4%
# changed, and the generator) these choose splits that code as small as candidates at 31 quantiles of the changed
# elements' magnitudes did (up to 0.5% smaller), from two histograms instead of two sorts (docs/profile.md, round 19).
SPLIT_BITS = 8
SPLIT_SAMPLES = 4096  # elements of the base, and changes, that the histograms sample (evenly spaced)
# Splitting costs the decoder a pass over the base; it is chosen only where the positions' estimated bits drop to
# this fraction of one class's or below.
SPLIT_GAIN = 0.93


def choose_split(bw: np.ndarray, idx: np.ndarray) -> int:
    """A magnitude threshold that makes the two classes' change rates differ most, or 0 when splitting won't pay.

    Estimated from samples (only the coded size depends on it): n * H2(p) bits for one class against the sum over
    two, for every threshold between two bins of magnitude >> shift (see SPLIT_BITS) that holds a sample; the first
    that costs least. Compiled (native.choose_split) or here, in the same floating-point operations in the same
    order (Python floats and libm's log2 both), so both choose the same threshold.
    """
    width = bw.dtype.itemsize
    n, c = bw.size, idx.size
    if width == 8 or c < 64 or n < 4096:  # width 8: thresholds would not fit a JSON double; small: no gain
        return 0
    shift = max(0, 8 * width - 1 - SPLIT_BITS)
    stride, istride = max(1, n // SPLIT_SAMPLES), max(1, c // SPLIT_SAMPLES)
    loops = native.loops()
    if loops is not None:
        return int(loops.choose_split(bw.view(np.uint8), width, stride, np.ascontiguousarray(idx, np.int64), istride,
                                      shift, SPLIT_GAIN))
    bins = 1 << (8 * width - 1 - shift)
    mask = bw.dtype.type((1 << (8 * width - 1)) - 1)
    samples = bw[::stride]
    base_hist = np.bincount((samples & mask) >> shift, minlength=bins).tolist()
    changed = bw[idx[::istride]]
    changed_hist = np.bincount((changed & mask) >> shift, minlength=bins).tolist()
    return _best_split(base_hist, changed_hist, n, c, samples.size, changed.size, shift)


def _xlog2x(v: float) -> float:
    return v * math.log2(v if v > 1.0 else 1.0)


def _best_split(base_hist: list[int], changed_hist: list[int], n: int, c: int, sb: int, sc: int, shift: int) -> int:
    """choose_split's estimate from its histograms (sb and sc samples): the numpy path's copy of the compiled loop,
    operation for operation (n H2(c/n) = f(n) - f(c) - f(n - c) with f(v) = v log2 v, 0 below 1)."""
    dn, dc = float(n), float(c)
    scale_n, scale_c = dn / float(sb), dc / float(sc)
    best, split = math.inf, 0
    cb = cc = 0
    for k in range(len(base_hist) - 1):
        cb += base_hist[k]
        cc += changed_hist[k]
        if not base_hist[k] and not changed_hist[k]:
            continue  # the same classes as the boundary before: never the first that costs least
        nh, ch = float(cb) * scale_n, float(cc) * scale_c
        ah, nl, cl = nh - ch, dn - nh, dc - ch
        al = nl - cl
        if ah < -0.5 or al < -0.5:
            continue  # the samples disagree: more changes than elements on one side
        cost = _xlog2x(nh) - _xlog2x(ch)
        cost -= _xlog2x(ah)
        cost += _xlog2x(nl)
        cost -= _xlog2x(cl)
        cost -= _xlog2x(al)
        if cost < best:
            best, split = cost, (k + 1) << shift
    whole = _xlog2x(dn) - _xlog2x(dc)
    whole -= _xlog2x(dn - dc)
    return split if best <= SPLIT_GAIN * whole else 0


@register
@dataclass(frozen=True)
class Sparse:
    """Only the changed elements: Rice-coded position gaps and sign/magnitude differences against the base.

    With split > 0 the elements are in two classes by base magnitude (< split: "low", first; the rest second) and
    each class numbers its own changes, which costs far fewer bits when one class changes much more often.
    Payload: per group, 5 + width streams (see Group.stream_sizes), each stored by streams.pack (raw, or one zstd
    frame when smaller); `frames` lists their stored lengths; then the trailer (streams.seal).
    """

    width: int
    split: int
    groups: tuple[Group, ...]
    frames: tuple[int, ...]
    name: ClassVar[str] = "sparse"
    needs_base: ClassVar[bool] = True

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "width": self.width, "split": self.split,
                "groups": [g.to_json() for g in self.groups], "frames": list(self.frames)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Sparse:
        if raw.keys() == _SPARSE_KEYS:
            # The usual, valid record in a few C-level checks (one per chunk a pull decodes: the field-by-field
            # path below took ~14 us of a ~100 us decode of a 0.5 MB bf16 chunk); anything else takes that path,
            # which says what is wrong.
            width, split, groups, frames = raw["width"], raw["split"], raw["groups"], raw["frames"]
            if (type(width) is int and width in streams.UINT and type(split) is int and 0 <= split < 1 << (8 * width - 1)
                    and type(groups) is list and len(groups) == (2 if split else 1) and type(frames) is list
                    and len(frames) == len(groups) * (5 + width) and _all_ints(frames) and min(frames) >= 0):
                parsed = tuple(map(Group.from_json, groups))  # the same errors as the path below
                if parsed[0].count or parsed[-1].count:
                    return cls(width, split, parsed, tuple(frames))
        f = fields(raw, ("width", "split", "groups", "frames"))
        width = width_field(f["width"])
        split = int_field(f["split"], "split", 0, (1 << (8 * width - 1)) - 1)
        groups, frames = f["groups"], f["frames"]
        if not isinstance(groups, list) or len(groups) != (2 if split else 1):
            raise FormatError(f"sparse: expected {2 if split else 1} groups, got {groups!r}")
        parsed = tuple(Group.from_json(g) for g in groups)
        if sum(g.count for g in parsed) < 1:
            raise FormatError("sparse: no changes listed (that chunk is 'same')")
        if not isinstance(frames, list) or len(frames) != len(parsed) * (5 + width):
            raise FormatError(f"sparse: frames must list {len(parsed) * (5 + width)} lengths")
        if _all_ints(frames) and min(frames) >= 0:
            return cls(width, split, parsed, tuple(frames))
        return cls(width, split, parsed, tuple(int_field(x, "frames[]", 0) for x in frames))

    @staticmethod
    def encode(nw: np.ndarray, bw: np.ndarray, idx: np.ndarray, level: int, split: int = 0,
               values: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[Sparse, bytes]:
        """nw, bw: new and base as width-byte unsigned ints; idx: ascending positions where they differ;
        values: (nw[idx], bw[idx]) when the caller has them already."""
        encoded = Sparse.encode_within(nw, bw, idx, level, None, split, values)
        assert encoded is not None  # no limit: always encoded
        return encoded

    @staticmethod
    def encode_within(nw: np.ndarray, bw: np.ndarray, idx: np.ndarray, level: int, limit: int | None,
                      split: int = 0, values: tuple[np.ndarray, np.ndarray] | None = None
                      ) -> tuple[Sparse, bytes] | None:
        """encode(), or None as soon as the payload is known to exceed limit bytes (another codec's payload that
        is kept unless this one is no larger). Streams that are stored raw count first; the others are compressed
        largest first, so a losing payload is usually known after one zstd call instead of 5 + width."""
        nv, bv = (nw[idx], bw[idx]) if values is None else values
        # Wrapping subtraction on the bit patterns: one ulp up or down is +-1 whatever the float format.
        diff = nv - bv
        if split:
            index = split_index(bw, split)
            low_r, low_d, high_r, high_d = index.partition(idx, diff)
            members = [(low_r, low_d, index.ones), (high_r, high_d, index.zeros)]
        else:
            members = [(idx, diff, nw.size)]
        groups: list[Group] = []
        parts: list[Any] = []  # 1-D byte arrays, bytes or memoryviews
        tries: list[bool] = []
        for r, d, space in members:
            g, p, t = _group_streams(r, d, space)
            groups.append(g)
            parts += p
            tries += t
        stored = _stored(parts, tries, level, limit)
        if stored is None:
            return None
        rec = Sparse(nw.dtype.itemsize, split, tuple(groups), tuple(map(len, stored)))
        return rec, streams.seal(stored)

    @staticmethod
    def encode_grouped(grouped: tuple[Any, ...], width: int, level: int, limit: int | None = None
                       ) -> tuple[dict[str, Any], bytes] | None:
        """encode_within()'s answer, its record as to_json gives it, for a chunk without split from its one group's
        streams as compare.changes_or_group returns them: the same bytes, without the objects between."""
        count, k, unary, remainder, signs, big, big_k, big_unary, big_remainder, *planes = grouped
        parts = [unary, remainder, signs, big_unary, big_remainder, *planes]
        stored = _stored(parts, _worth_trying(parts, width), level, limit)
        if stored is None:
            return None
        group = {"count": count, "rice": k, "unary": len(unary), "big": big, "big_rice": big_k,
                 "big_unary": len(big_unary)}
        return ({"name": "sparse", "width": width, "split": 0, "groups": [group], "frames": list(map(len, stored))},
                streams.seal(stored))

    def _stored_streams(self, data: memoryview, gi: int, pos: int, *, as_arrays: bool) -> tuple[list[Any], int]:
        """Group gi's 5 + width streams from the payload at pos, decompressed where stored as a zstd frame; raw
        ones as views of the payload (uint8 arrays with as_arrays). Returns them and the position after them."""
        parts: list[Any] = []
        per = 5 + self.width
        for j, plain in enumerate(self.groups[gi].stream_sizes(self.width)):
            stored = self.frames[gi * per + j]
            piece = data[pos:pos + stored]
            if stored == plain:  # raw (stored length = decoded length): no name for errors to format
                parts.append(np.frombuffer(piece, np.uint8) if as_arrays else piece)
            else:
                parts.append(streams.decompress(piece, plain, f"sparse stream {gi}.{j}"))
            pos += stored
        return parts, pos

    def _decode_compiled(self, c: Any, data: memoryview, b: np.ndarray, n: int,
                         out: np.ndarray | None) -> np.ndarray | None:
        """decode() of a chunk without split in one compiled call (native.ungroup): the streams are checked and
        the changes added while base is copied into out. None, with out untouched, when the compiled checks refuse
        the streams: the numpy path then decodes them again and says what is wrong."""
        g, width = self.groups[0], self.width
        parts, _ = self._stored_streams(data, 0, 0, as_arrays=False)
        planes = parts[5] if width == 1 else b"".join(parts[5:])
        target = np.empty(n * width, np.uint8) if out is None else out
        status = c.ungroup(target, None if target is b else b, width, n, g.count, g.rice, g.big, g.big_rice,
                           parts[0], parts[1], parts[2], parts[3], parts[4], planes)
        return target if status == 0 else None

    def decode(self, payload: bytes | None, base: np.ndarray | None, size: int,
               out: np.ndarray | None = None) -> np.ndarray:
        _check_width(self.name, self.width, size)
        b = _need_base(self.name, base, size)
        data = streams.unseal(_need_payload(self.name, payload), "sparse chunk")
        n = size // self.width
        if sum(g.count for g in self.groups) > n:
            raise IntegrityError("sparse: more changes than elements", expected=n, actual=sum(g.count for g in self.groups))
        if sum(self.frames) != len(data):
            raise IntegrityError("sparse: payload size differs from its frames", expected=sum(self.frames),
                                 actual=len(data))
        for g in self.groups:
            # A valid unary stream has count one bits within the n + count bits the gaps can span. Checked before
            # any stream is decompressed, as is big (it sizes the big remainders and the planes): a record may not
            # make the decoder inflate more than the chunk can hold.
            if g.unary > (n + g.count + 8) // 8 or g.big_unary > (2 * g.count + 7) // 8:
                raise IntegrityError("sparse: gap stream larger than the chunk allows")
            if g.big > g.count:
                raise IntegrityError("sparse: more large differences than changes", expected=g.count, actual=g.big)
        c = native.loops()
        if c is not None and not self.split:
            done = self._decode_compiled(c, data, b, n, out)
            if done is not None:
                return done
        dtype = streams.UINT[self.width]
        bw = b.view(dtype)
        index = split_index(bw, self.split) if self.split else None
        pos = 0
        updates = []
        for gi, g in enumerate(self.groups):
            parts, pos = self._stored_streams(data, gi, pos, as_arrays=True)
            if index is None:
                space = n
            else:
                space = index.ones if gi == 0 else index.zeros
            changes = _decode_group(g, parts, space, dtype)
            if not g.count:
                continue
            if index is not None:  # ranks within the class to element indexes
                changes = replace(changes, where=index.select(changes.where, 1 if gi == 0 else 0))
            updates.append(changes)
        # Everything is decoded and checked before the first byte of out is written, so a damaged payload
        # leaves an in-place base untouched.
        if out is None:
            out = b.copy()
        elif out is not b:
            np.copyto(out, b)
        ow = out.view(dtype)
        for changes in updates:
            _apply(ow, changes)  # positions are distinct; wraps, inverting the encoder's subtraction
        return out
