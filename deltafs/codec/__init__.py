"""Lossless per-chunk encodings against a base chunk. Pure functions over bytes; no I/O.

encode() picks the cheapest of: same (no bytes), sparse, xor, raw. decode() inverts any of them.
The exact byte layouts are specified in manifests/FORMAT.md, "Chunk encodings".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard

from deltafs.errors import FormatError, IntegrityError

DEFAULT_LEVEL = 3


@dataclass(frozen=True)
class Encoded:
    """One encoded chunk: its codec record (JSON-able), the stored payload, and what changed."""

    codec: dict[str, Any]
    payload: bytes | None
    changed: int  # elements that differ from the base (all of them when there is no base)


def _as_u8(buf: Any) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.view(np.uint8).reshape(-1)


def _planes(data: np.ndarray, itemsize: int) -> np.ndarray:
    if itemsize == 1:
        return data
    return np.ascontiguousarray(data.reshape(-1, itemsize).T).reshape(-1)


def _unplanes(data: np.ndarray, itemsize: int) -> np.ndarray:
    if itemsize == 1:
        return data
    return np.ascontiguousarray(data.reshape(itemsize, -1).T).reshape(-1)


def _compress(data: np.ndarray, level: int) -> bytes:
    return zstandard.ZstdCompressor(level=level).compress(data.tobytes())


def _decompress(payload: bytes, size: int) -> np.ndarray:
    try:
        out = zstandard.ZstdDecompressor().decompress(payload, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"chunk does not decompress: {exc}") from None
    if len(out) != size:
        raise IntegrityError("chunk decompressed to the wrong size", expected=size, actual=len(out))
    return np.frombuffer(out, dtype=np.uint8)


def encode(new: Any, base: Any | None, itemsize: int, *, level: int = DEFAULT_LEVEL) -> Encoded:
    """Encode new (bytes-like) against base (same length) or against nothing."""
    n = _as_u8(new)
    unit = itemsize if n.size % itemsize == 0 else 1
    if base is None:
        return Encoded({"name": "raw", "planes": unit}, _compress(_planes(n, unit), level), n.size // unit)
    b = _as_u8(base)
    if b.size != n.size:
        raise ValueError("base and new chunk differ in size")
    x = np.bitwise_xor(n, b)
    changed = int(np.count_nonzero(x.reshape(-1, unit).any(axis=1))) if n.size else 0
    if changed == 0:
        return Encoded({"name": "same"}, None, 0)
    xor = _compress(_planes(x, unit), level)
    raw = _compress(_planes(n, unit), level)
    if len(raw) < len(xor):
        return Encoded({"name": "raw", "planes": unit}, raw, changed)
    return Encoded({"name": "xor", "planes": unit}, xor, changed)


def decode(codec: dict[str, Any], payload: bytes | None, base: Any | None, size: int, itemsize: int) -> np.ndarray:
    """The chunk's bytes as a uint8 array of exactly size bytes."""
    name = codec.get("name")
    if name == "same":
        if base is None:
            raise FormatError("chunk 'same' needs a base")
        b = _as_u8(base)
        if b.size != size:
            raise IntegrityError("base chunk has the wrong size", expected=size, actual=b.size)
        return b
    unit = int(codec.get("planes", 1))
    if unit not in (1, 2, 4, 8) or size % unit:
        raise FormatError(f"bad plane count {unit} for a chunk of {size} bytes")
    if payload is None:
        raise FormatError(f"chunk '{name}' has no payload")
    if name == "raw":
        return _unplanes(_decompress(payload, size), unit)
    if name == "xor":
        if base is None:
            raise FormatError("chunk 'xor' needs a base")
        b = _as_u8(base)
        if b.size != size:
            raise IntegrityError("base chunk has the wrong size", expected=size, actual=b.size)
        return np.bitwise_xor(_unplanes(_decompress(payload, size), unit), b)
    raise FormatError(f"unknown chunk codec {name!r}")
