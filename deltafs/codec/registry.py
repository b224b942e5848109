"""Codec records: each chunk encoding is a frozen dataclass registered by name that round-trips through JSON.

A manifest stores `codec.to_json()` next to the chunk, so the record alone says how to decode the stored bytes
(zarr v3 style: an encoding is data, not a code path). Unknown names and malformed records are FormatError.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, TypeVar

import numpy as np

from deltafs.errors import FormatError


class Codec(Protocol):
    """What every registered codec record provides."""

    name: ClassVar[str]
    needs_base: ClassVar[bool]

    def to_json(self) -> dict[str, Any]: ...

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Codec: ...

    def decode(self, payload: bytes | None, base: np.ndarray | None, size: int,
               out: np.ndarray | None = None) -> np.ndarray: ...


_REGISTRY: dict[str, type[Codec]] = {}

C = TypeVar("C", bound=type)


def register(cls: C) -> C:
    """Class decorator: make a codec record decodable by its name."""
    name = cls.name  # type: ignore[attr-defined]
    if name in _REGISTRY:
        raise ValueError(f"codec {name!r} registered twice")
    _REGISTRY[name] = cls
    return cls


def registered() -> dict[str, type[Codec]]:
    """Name -> record class, for docs and tests."""
    return dict(_REGISTRY)


# Records with no parameters but a width (same, raw, xor, dense) are few and frozen: parsed once, then shared.
# A cache, not state: a record is only cached after the full parse accepted it, under the exact JSON it came from.
_SIMPLE: dict[tuple[Any, Any], Codec] = {}


def _simple_key(raw: dict[str, Any]) -> tuple[Any, Any] | None:
    if type(raw.get("name")) is not str:  # also keeps unhashable names (lists, objects) out of the cache's lookup
        return None
    if len(raw) == 1:
        return (raw.get("name"), None)
    width = raw.get("width")
    if len(raw) == 2 and type(width) is int:  # exactly int: True and 2.0 compare equal to 1 and 2
        return (raw.get("name"), width)
    return None


def from_json(raw: Any) -> Codec:
    """The codec record a manifest describes; FormatError for an unknown name or malformed fields."""
    key = _simple_key(raw) if type(raw) is dict else None
    if key is not None:
        rec = _SIMPLE.get(key)
        if rec is not None:
            return rec
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise FormatError(f"codec record must be an object with a name, got {raw!r}")
    cls = _REGISTRY.get(raw["name"])
    if cls is None:
        raise FormatError(f"unknown chunk codec {raw['name']!r}")
    rec = cls.from_json(raw)
    if key is not None and type(raw["name"]) is str and rec.to_json() == raw:
        _SIMPLE[key] = rec
    return rec


def fields(raw: dict[str, Any], allowed: tuple[str, ...]) -> dict[str, Any]:
    """raw without its name; FormatError on keys the record does not define (a newer format, or a typo)."""
    extra = set(raw) - set(allowed) - {"name"}
    if extra:
        raise FormatError(f"codec {raw['name']!r} has unknown fields {sorted(extra)}")
    missing = [k for k in allowed if k not in raw]
    if missing:
        raise FormatError(f"codec {raw['name']!r} lacks fields {missing}")
    return {k: raw[k] for k in allowed}


def int_field(value: Any, what: str, low: int = 0, high: int | None = None) -> int:
    """A JSON integer within [low, high]; FormatError otherwise (bools are not integers here)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise FormatError(f"codec field {what} must be an integer in {bound}, got {value!r}")
    return value


def width_field(value: Any) -> int:
    width = int_field(value, "width", 1, 8)
    if width not in (1, 2, 4, 8):
        raise FormatError(f"codec field width must be 1, 2, 4 or 8, got {width}")
    return width
