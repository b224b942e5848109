"""The gamma codec: each element's zigzag difference as its bit length plus the bits below its leading one.

For chunks where nearly every element moved by an amount spread over many bits (LayerNorm biases and gains, F32
weights after an optimizer step): the bit length of a difference is what a coder can predict, the bits below its
leading one are close to uniform, so the lengths are Rice-coded and the rest is stored as it is. On the trained
data set's 162 small F32 tensors this is 0.84x the bytes of `dense` (byte planes through zstd, whose tables cost
~100 bytes per small chunk) and within 3% of an ideal coder of the same model (docs/benchmarks.md). Byte layout:
manifests/FORMAT.md, "gamma".

Compiled loops (deltafs/codec/_native.c: lengths, gamma, ungamma) when built; the numpy code below writes and
reads exactly the same bytes (tests/codec/test_gamma.py runs both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import numpy as np

from deltafs.codec import native, streams
from deltafs.codec.codecs import _check_width, _need_base, _need_payload
from deltafs.codec.compare import unzigzag, zigzag
from deltafs.codec.registry import fields, int_field, register, width_field
from deltafs.errors import FormatError, IntegrityError

WIDTHS = (1, 2, 4)  # a difference's bits below its leading one must fit 31 bits (and the decoder's 40-bit window)
MAX_RICE = 8  # lengths are at most 33 apart, so larger Rice parameters never pay
_KEYS = frozenset(("name", "width", "center", "rice", "unary"))


class Layout(NamedTuple):
    """The parameters and stream sizes a chunk's length histogram leads to (layout())."""

    center: int
    rice: int
    unary: int  # bytes of each stream
    remainder: int
    mantissa: int

    @property
    def payload(self) -> int:
        return self.unary + self.remainder + self.mantissa + streams.TRAILER


class Counts(NamedTuple):
    """One pass over a chunk's differences: what the gamma coder and the writer's choice need."""

    hist: np.ndarray  # elements per bit length 0 .. 8w of the zigzag difference (int64)
    changed: int  # elements that differ from the base
    repeats: int  # elements whose difference equals the previous element's
    skew: float  # bytes a coder of the 3 bits below each leading one by their frequencies would save (_skew)
    plan: Layout  # layout(hist)


_tuple = tuple.__new__


def count(nw: np.ndarray, bw: np.ndarray) -> Counts:
    """Counts of new against base (width-byte unsigned ints, width 1, 2 or 4), in one compiled call where built.

    (Named tuples, not dataclasses: one is made per small chunk, and a frozen dataclass costs ~1.5 us to build.)
    """
    width = nw.dtype.itemsize
    c = native.loops()
    if c is not None:
        hist = np.empty(8 * width + 1, np.int64)  # lengths() fills every entry
        r = c.lengths(nw, bw, width, hist)  # (changed, repeats, skew, *layout)
        # tuple.__new__ makes the named tuples without their Python-level __new__ (one pair per small chunk).
        return _tuple(Counts, (hist, r[0], r[1], r[2], _tuple(Layout, r[3:])))
    hist = np.zeros(8 * width + 1, np.int64)
    z = zigzag(nw - bw)
    lengths = _bit_lengths(z)
    hist[:] = np.bincount(lengths, minlength=8 * width + 1)
    return Counts(hist, int(nw.size - hist[0]), int(np.count_nonzero(z[1:] == z[:-1])), _skew(z, lengths, width),
                  layout(hist))


class Alone(NamedTuple):
    """When a chunk is written as gamma without trying another codec (deltafs.codec's test, with its size limit),
    and from what share of changes below that its payload is written anyway, as a candidate."""

    changed_from: float  # changed >= changed_from * elements (and at least one)
    payload_within: float  # payload bytes <= payload_within * chunk bytes
    repeats_below: float  # repeats < repeats_below * elements
    skew_below: float  # skew < skew_below * payload bytes
    written_from: float  # written_from * elements <= changed < changed_from * elements: written as a candidate


def passes(counts: Counts, elements: int, alone: Alone) -> bool:
    """Whether counts pass alone's tests but the payload's size."""
    return (counts.changed > 0 and counts.changed >= alone.changed_from * elements
            and counts.repeats < alone.repeats_below * elements and counts.skew < alone.skew_below * counts.plan.payload)


def count_and_write(n: np.ndarray, b: np.ndarray, width: int, alone: Alone) -> tuple[Counts, bytes | None]:
    """count() of new against base (uint8; width 1, 2 or 4), and the gamma payload too when it is within alone's
    size limit and the counts pass alone's test or make it a candidate, else None. One compiled call where built (a
    small F32 step's whole encode); the same answer and bytes in numpy."""
    c = native.loops()
    if c is not None:
        hist = np.empty(8 * width + 1, np.int64)
        r = c.counted(n, b, width, hist, *alone, streams.digest)
        return _tuple(Counts, (hist, r[0], r[1], r[2], _tuple(Layout, r[3:8]))), r[8]
    if width not in WIDTHS or n.size != b.size or n.size % width:  # as the compiled call refuses them
        raise ValueError("counted: width must be 1, 2 or 4 and the buffers sized alike")
    dtype = streams.UINT[width]
    nw, bw = n.view(dtype), b.view(dtype)
    counts = count(nw, bw)
    candidate = alone.written_from * nw.size <= counts.changed < alone.changed_from * nw.size
    if ((passes(counts, nw.size, alone) or (candidate and counts.changed > 0))
            and counts.plan.payload <= alone.payload_within * n.size):
        return counts, payload(nw, bw, counts.plan)
    return counts, None


def _skew(z: np.ndarray, lengths: np.ndarray, width: int) -> float:
    """Bytes a coder of the three bits below each leading one, by their frequencies per bit length, would save
    against storing them as they are, as gamma does: the sum over lengths L >= 4 of 3 n_L - n_L H_L bits (H_L the
    empirical entropy of those bits among the n_L differences of length L) less Miller-Madow's (K_L - 1) / (2 ln 2)
    bits for the K_L values that occur (a few hundred draws read low), over 8, and never below 0.

    Where the bits below the leading one are close to uniform (an optimizer step on F32 weights: gamma's case) this
    is a small fraction of the payload; where steps cluster within their length (a relative step of fixed size,
    bits that repeat per exponent) zstd on dense's byte planes can be the smaller. The compiled lengths() computes
    the same sum in the same order.
    """
    long_ = lengths >= 4
    at = lengths[long_]
    top = (z[long_] >> (at - 4).astype(z.dtype)) & 7
    rows = np.bincount(8 * at + top.astype(np.int64), minlength=8 * (8 * width + 1)).reshape(-1, 8)
    saved = 0.0
    for row in rows[4:]:
        n = int(row.sum())
        if not n:
            continue
        bits = 3.0 * n - (int(np.count_nonzero(row)) - 1) / (2.0 * math.log(2))
        for t in row:
            if t:
                bits += float(t) * math.log2(float(t) / n)
        saved += bits
    return saved / 8 if saved > 0 else 0.0


def _length_codes(s: np.ndarray) -> np.ndarray:
    """The Rice-coded values of bit lengths s = L - center (signed): 0, -1, 1, -2 ... -> 0, 1, 2, 3 ...; the
    decoder's inverse is in Gamma._differences."""
    out: np.ndarray = np.where(s >= 0, 2 * s, -2 * s - 1)
    return out


def _bit_lengths(z: np.ndarray) -> np.ndarray:
    # frexp's exponent is the bit length of a positive integer (exact: z < 2**32 fits a float64) and 0 for 0.
    return np.frexp(z.astype(np.float64))[1].astype(np.int64)


def layout(hist: np.ndarray) -> Layout:
    """The (center, Rice parameter) that code these lengths in the fewest bytes, and the streams' sizes.

    Every pair is costed exactly from the histogram: centers between the shortest and the longest length that
    occur (one outside codes no smaller than that end), parameters 0 .. 8; ties go to the smallest center, then the
    smallest parameter. Compiled (plan; it skips parameters that cannot win) when built, else one numpy expression
    over every pair: the same answer.
    """
    c = native.loops()
    if c is not None:
        return Layout(*c.plan(hist))
    n = int(hist.sum())
    lens = np.arange(hist.size)
    mantissa = (int((np.maximum(lens - 1, 0) * hist).sum()) + 7) // 8
    occur = np.flatnonzero(hist)
    centers = np.arange(occur[0], occur[-1] + 1) if occur.size else np.zeros(1, np.int64)
    g = _length_codes(lens[None, :] - centers[:, None])  # [center, length]
    ks = np.arange(MAX_RICE + 1)
    unary_bits = ((g[:, None, :] >> ks[None, :, None]) + 1) * hist  # [center, k, length]
    cost = (unary_bits.sum(axis=2) + 7) // 8 + (n * ks[None, :] + 7) // 8
    row, k = np.unravel_index(int(np.argmin(cost)), cost.shape)  # first minimum in row-major order
    return Layout(int(centers[row]), int(k), int((unary_bits[row, k].sum() + 7) // 8), (n * int(k) + 7) // 8,
                  mantissa)


@register
@dataclass(frozen=True)
class Gamma:
    """Bit lengths of the zigzag differences, Rice-coded around a center, then the bits below each leading one."""

    width: int
    center: int
    rice: int
    unary: int
    name: ClassVar[str] = "gamma"
    needs_base: ClassVar[bool] = True

    def to_json(self) -> dict[str, Any]:
        return _record(self.width, self.center, self.rice, self.unary)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Gamma:
        if raw.keys() == _KEYS:
            # The usual, valid record in a few C-level checks (one per small chunk a pull decodes); anything else
            # takes the field-by-field path below, which says what is wrong.
            width, center, rice, unary = raw["width"], raw["center"], raw["rice"], raw["unary"]
            if (type(width) is int and type(center) is int and type(rice) is int and type(unary) is int
                    and width in WIDTHS and 0 <= center <= 8 * width and 0 <= rice <= MAX_RICE and unary >= 0):
                return cls(width, center, rice, unary)
        f = fields(raw, ("width", "center", "rice", "unary"))
        width = width_field(f["width"])
        if width not in WIDTHS:
            raise FormatError(f"gamma: width {width} is not one of {WIDTHS}")
        return cls(width, int_field(f["center"], "gamma center", 0, 8 * width),
                   int_field(f["rice"], "gamma rice", 0, MAX_RICE), int_field(f["unary"], "gamma unary"))

    @staticmethod
    def encode(nw: np.ndarray, bw: np.ndarray, plan: Layout | None = None) -> tuple[Gamma, bytes]:
        """nw, bw: new and base as width-byte unsigned ints (width 1, 2 or 4); plan: count(nw, bw).plan if
        the caller has it."""
        width = nw.dtype.itemsize
        if width not in WIDTHS:
            raise ValueError(f"gamma: width {width} is not one of {WIDTHS}")
        if plan is None:
            plan = count(nw, bw).plan
        return Gamma(width, plan.center, plan.rice, plan.unary), payload(nw, bw, plan)

    def decode(self, payload: bytes | None, base: np.ndarray | None, size: int,
               out: np.ndarray | None = None) -> np.ndarray:
        width = self.width
        _check_width(self.name, width, size)
        base = _need_base(self.name, base, size)
        body = streams.unseal(_need_payload(self.name, payload), "gamma chunk")
        n = size // width
        target = np.empty(size, np.uint8) if out is None else out
        c = native.loops()
        # out may be base, or overlap it otherwise: the compiled loop writes in the order that reads every base
        # element before it is written, as numpy's add below does.
        if c is not None and c.ungamma(body, self.unary, width, self.center, self.rice, base, target) == 0:
            return target
        # The numpy decode: also where the compiled one refused, so both refuse with the same message.
        rem_end = self.unary + (n * self.rice + 7) // 8
        if rem_end > len(body):
            raise IntegrityError("gamma chunk: payload shorter than its unary and remainder streams",
                                 expected=rem_end, actual=len(body))
        data = np.frombuffer(body, np.uint8)
        un, rem, man = data[:self.unary], data[self.unary:rem_end], data[rem_end:]
        d = self._differences(un, rem, man, n)
        dtype = streams.UINT[width]
        np.add(base.view(dtype), d, out=target.view(dtype))  # wraps, inverting the encoder's subtraction
        return target

    def _differences(self, un: np.ndarray, rem: np.ndarray, man: np.ndarray, n: int) -> np.ndarray:
        """The n differences (width-byte unsigned, wrapping) the streams hold, or IntegrityError."""
        width, k = self.width, self.rice
        limit = 2 * 8 * width + 2  # codes past the largest valid zigzag of L - center
        pos = streams.rice_positions(un, rem, n, k, n * (limit << k) + 1, "gamma chunk")
        g = streams.gaps_of(pos, None) if n else np.zeros(0, np.int64)
        lens = self.center + np.where(g & 1, -((g + 1) >> 1), g >> 1)
        if lens.size and (int(lens.min()) < 0 or int(lens.max()) > 8 * width):
            raise IntegrityError("gamma chunk: a bit length out of range")
        low = np.maximum(lens - 1, 0)
        total = int(low.sum())
        pad = (-total) % 8
        if man.size != (total + 7) // 8 or (pad and int(man[-1]) & ((1 << pad) - 1)):
            raise IntegrityError("gamma chunk: the low-bits stream has the wrong size or padding",
                                 expected=(total + 7) // 8, actual=man.size)
        z = np.where(lens > 0, np.left_shift(np.uint64(1), np.maximum(lens - 1, 0).astype(np.uint64)), 0)
        z = z.astype(np.uint64) | _read_fields(man, low)
        dtype = streams.UINT[width]
        return unzigzag(z.astype(dtype))


def record(width: int, plan: Layout) -> dict[str, Any]:
    """Gamma(width, plan.center, plan.rice, plan.unary).to_json(), without the object (one per small chunk)."""
    return _record(width, plan.center, plan.rice, plan.unary)


def _record(width: int, center: int, rice: int, unary: int) -> dict[str, Any]:
    return {"name": Gamma.name, "width": width, "center": center, "rice": rice, "unary": unary}


def payload(nw: np.ndarray, bw: np.ndarray, plan: Layout) -> bytes:
    """The gamma payload of new against base (width-byte unsigned ints, width in WIDTHS, not checked here):
    the streams plan (count(nw, bw).plan) sizes, then the trailer."""
    # One buffer: the streams are written in place, then the trailer after them.
    out = bytearray(plan.unary + plan.remainder + plan.mantissa + streams.TRAILER)
    c = native.loops()
    if c is not None:
        c.gamma(nw, bw, nw.dtype.itemsize, plan.center, plan.rice, plan.unary, plan.remainder, out)
    else:
        body = np.frombuffer(out, np.uint8)
        un = body[:plan.unary]
        rem = body[plan.unary:plan.unary + plan.remainder]
        _encode_numpy(nw, bw, plan, un, rem, body[plan.unary + plan.remainder:len(out) - streams.TRAILER])
    streams.trail(out)
    return bytes(out)


def _encode_numpy(nw: np.ndarray, bw: np.ndarray, plan: Layout, un: np.ndarray, rem: np.ndarray,
                  man: np.ndarray) -> None:
    """The compiled gamma() in numpy, into the three zeroed stream buffers."""
    z = zigzag(nw - bw).astype(np.uint64)
    lens = _bit_lengths(z)
    g = _length_codes(lens - plan.center)
    u, r = streams.rice_encode(g, plan.rice)
    un[:] = u
    rem[:] = r
    low = np.maximum(lens - 1, 0)
    total = int(low.sum())
    if not total:
        return
    # Bit j (from the bottom) of element i's low bits goes to bit start_i + low_i - 1 - j of the stream: one
    # vectorized pass per bit position, over the elements that have that many bits.
    bits = np.zeros(man.size * 8, np.uint8)
    start = np.cumsum(low) - low
    for j in range(int(low.max())):
        sel = np.flatnonzero(low > j)
        bits[start[sel] + low[sel] - 1 - j] = (z[sel] >> np.uint64(j)) & np.uint64(1)
    man[:] = np.packbits(bits)


# Fields read per block by _read_fields: its temporaries take ~100 bytes per field, so a 4 MiB chunk of 1-byte
# elements (4 Mi fields) would need ~400 MB at once.
_FIELDS_PER_BLOCK = 1 << 16


def _read_fields(buf: np.ndarray, nbits: np.ndarray) -> np.ndarray:
    """The consecutive MSB-first fields of nbits[i] <= 31 bits each from buf, as uint64 (vectorized: a 40-bit
    big-endian window at each field's first byte holds it whole), a block of fields at a time."""
    start = np.cumsum(nbits) - nbits
    padded = np.zeros(buf.size + 5, np.uint8)
    padded[:buf.size] = buf
    weights = np.array([32, 24, 16, 8, 0], np.uint64)
    result = np.empty(nbits.size, np.uint64)
    for lo in range(0, nbits.size, _FIELDS_PER_BLOCK):
        s, b = start[lo:lo + _FIELDS_PER_BLOCK], nbits[lo:lo + _FIELDS_PER_BLOCK]
        idx = (s >> 3)[:, None] + np.arange(5)
        window = (padded[idx].astype(np.uint64) << weights).sum(axis=1, dtype=np.uint64)
        shift = (40 - (s & 7) - b).astype(np.uint64)
        result[lo:lo + b.size] = (window >> shift) & ((np.uint64(1) << b.astype(np.uint64)) - np.uint64(1))
    return result
