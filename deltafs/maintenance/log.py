"""The version history of a store, one record per version."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

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


def log(store: str | Repository, *, storage_options: dict[str, Any] | None = None, limit: int | None = None,
        since: int | str | None = None) -> list[LogEntry]:
    """Committed versions, oldest first.

    limit keeps the newest N; since keeps versions >= an int, or created at or after an ISO 8601 UTC
    time (a prefix such as "2026-12-01" works). Only the manifests shown are read, and the bridge of each full
    version shown that has a parent.
    """
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
        st = man.stats
        written = int(st.get("chunk_bytes_stored", 0)) + repo.manifest_size(v)
        full = int(st.get("full_bytes", man.raw_bytes))
        total = int(st.get("elements_total", 0))
        changed = (int(st.get("elements_changed", 0)) / total if total else 0.0) if man.kind == "delta" else None
        bridge = load_bridge_sized(repo, man)  # one get per full version shown that has a parent
        bridge_bytes = None if bridge is None else int(bridge[0].stats.get("chunk_bytes_stored", 0)) + bridge[1]
        out.append(LogEntry(v, man.kind, man.parent, changed, written, full, round(full / written, 2) if written else None,
                            man.created, man.metadata, head is not None and head.version == v, bridge_bytes))
    out.reverse()
    return out
