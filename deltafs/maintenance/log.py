"""The version history of a store, one record per version."""

from __future__ import annotations

import datetime as _dt
import re
from dataclasses import asdict, dataclass
from typing import Any

from deltafs.errors import UsageError
from deltafs.store.accelerators import load_bridge_sized
from deltafs.store.repo import Repository


@dataclass(frozen=True)
class LogEntry:
    version: int
    kind: str
    parent: int | None
    changed_fraction: float | None
    bytes_written: int
    full_bytes: int
    ratio: float | None
    created: str
    metadata: dict[str, Any]
    head: bool
    # A full version's bridge from its parent (manifests/FORMAT.md, "Bridges"): what a host at the parent reads
    # instead of the full version, its chunks plus its manifest; None when there is no usable bridge.
    bridge_bytes: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# A UTC time as manifests record it, or a prefix of one: a year, a month, a day, then hours, minutes, seconds.
_SINCE = re.compile(r"^(\d{4})(?:-(\d{2})(?:-(\d{2})(?:T(\d{2})(?::(\d{2})(?::(\d{2})(?:\.\d{1,6})?)?)?)?)?)?Z?$")


def parse_since(text: str) -> int | str:
    """--since as log() takes it: a version number (digits alone), or an ISO 8601 UTC time or a prefix of one ("2026-12",
    "2026-12-01T08:00", a space for the T); UsageError for anything else (it would select nothing, or everything)."""
    if text.isdigit():
        return int(text)
    value = text.strip().replace(" ", "T", 1).removesuffix("Z")
    m = _SINCE.match(value)
    if m is not None:
        year, month, day, hour, minute, second = (int(g) if g else None for g in m.groups())
        try:
            _dt.datetime(year or 1, month or 1, day or 1, hour or 0, minute or 0, second or 0)
        except ValueError:
            m = None
    if m is None:
        raise UsageError(f"--since must be a version number or a UTC time such as 2026-12-01 or 2026-12-01T08:00, "
                         f"got {text!r}")
    return value


def log(store: str | Repository, *, storage_options: dict[str, Any] | None = None, limit: int | None = None,
        since: int | str | None = None) -> list[LogEntry]:
    """Committed versions, oldest first.

    limit keeps the newest N; since keeps versions >= an int, or created at or after an ISO 8601 UTC
    time (a prefix such as "2026-12-01" works). Only the manifests shown are read, and the bridge of each full
    version shown that has a parent.
    """
    if isinstance(since, str):
        since = parse_since(since)  # before anything is read: it refuses what would select nothing (or everything)
    repo = store if isinstance(store, Repository) else Repository.open(store, storage_options)
    head = repo.head()
    out: list[LogEntry] = []
    versions = repo.versions()
    if isinstance(since, int):
        versions = [v for v in versions if v >= since]
    for v in reversed(versions):
        if limit is not None and len(out) >= limit:
            break
        man = repo.manifest(v)
        if isinstance(since, str) and man.created < since:
            break  # versions are committed in time order: older ones follow
        written = man.count("chunk_bytes_stored") + repo.manifest_size(v)
        full = man.count("full_bytes", man.raw_bytes)
        total = man.count("elements_total")
        changed = (man.count("elements_changed") / total if total else 0.0) if man.kind == "delta" else None
        bridge = load_bridge_sized(repo, man)  # one get per full version shown that has a parent
        bridge_bytes = None if bridge is None else bridge[0].count("chunk_bytes_stored") + bridge[1]
        out.append(LogEntry(v, man.kind, man.parent, changed, written, full, round(full / written, 2) if written else None,
                            man.created, man.metadata, head is not None and head.version == v, bridge_bytes))
    out.reverse()
    return out
