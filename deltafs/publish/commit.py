"""The commit: every chunk durable and present, then the manifest (the commit point), then HEAD.

A gc may run while a push writes. Two rules keep it from deleting what the push will reference
(FORMAT.md, "gc and locking"):
- chunks this push wrote are protected by its in-flight marker (deltafs.store.lock.PushGuard);
  if the marker may have lapsed (the process was frozen longer than the marker's ttl), every one of
  them is checked again before the commit;
- chunks it found already stored (deduplicated) are older than the push, so the marker does not
  cover them: they are always checked again, after any running gc has finished.
A chunk found missing makes the push encode again (ChunksGoneError, retried by the pipeline).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from deltafs.errors import LockHeldError, VersionConflictError
from deltafs.format.manifest import FileEntry, Head, Manifest, referenced_bytes, referenced_objects
from deltafs.parallel import ordered_map
from deltafs.publish.encode import EncodeStats
from deltafs.store.lock import PushGuard, is_stale, read_lock
from deltafs.format.records import utcnow
from deltafs.store.repo import Repository

log = logging.getLogger("deltafs")

# How long a push waits for a running gc before giving up (a gc of a large store takes minutes).
GC_WAIT_SECONDS = 900.0


class ChunksGoneError(VersionConflictError):
    """A gc removed chunks this push references; the push encodes again and writes them anew."""


ReusedChunksGoneError = ChunksGoneError  # the name before in-flight markers also covered written chunks


def stats_record(stats: EncodeStats, full_bytes: int) -> dict[str, Any]:
    """What every manifest a push writes records of its encode (`stats`; manifests/FORMAT.md)."""
    return {"full_bytes": full_bytes, "chunk_bytes_stored": stats.stored, "chunks_total": stats.chunks_total,
            "chunks_stored": stats.chunks_written, "elements_total": stats.elements_total,
            "elements_changed": stats.elements_changed}


def accelerator_manifest(man: Manifest, parent: int, parent_digest: str, files: Iterable[FileEntry],
                         stats: EncodeStats, *, role: str, created: str) -> Manifest:
    """A second manifest of version `man`, a fold or a bridge (manifests/FORMAT.md): its version, files and metadata,
    encoded as a delta against version `parent`, with `stats[role]` ("fold_of", "bridge_of") naming man's digest;
    sealed and checked."""
    return Manifest(store_id=man.store_id, version=man.version, parent=parent, parent_digest=parent_digest,
                    kind="delta", chunk_bytes=man.chunk_bytes, created=created,
                    files=tuple(sorted(files, key=lambda f: f.path)), metadata=man.metadata,
                    stats={role: man.digest, **stats_record(stats, man.raw_bytes)}).sealed()


def seal_manifest(repo: Repository, *, version: int, kind: str, parent: Manifest | None, files: list[FileEntry],
                  metadata: Mapping[str, Any], stats: EncodeStats,
                  extra_stats: Mapping[str, Any] | None = None) -> Manifest:
    """The new version's manifest, with the stats the keyframe policy and `log` read; sealed and checked."""
    delta = kind == "delta" and parent is not None
    record: dict[str, Any] = {
        **stats_record(stats, sum(f.size for f in files)),
        # Delta bytes since the last full version (0 for a full version): what the keyframe budget compares, so
        # what readers fetch (the objects each delta names), not what this push happened to store.
        "chain_bytes": referenced_bytes(files) + parent.count("chain_bytes") if delta and parent else 0,
        "since_full": parent.count("since_full") + 1 if delta and parent else 0,
        **(extra_stats or {}),
    }
    return Manifest(
        store_id=repo.store_id,
        version=version,
        parent=parent.version if parent else None,
        parent_digest=parent.digest if parent else None,
        kind=kind,
        chunk_bytes=repo.config.chunk_bytes,
        created=utcnow(),
        files=tuple(files),
        metadata=dict(metadata),
        stats=record,
    ).sealed()  # never commit a manifest that a reader would refuse (checked like a parsed one)


def commit_version(repo: Repository, man: Manifest, *, head_seen: Head | None, stats: EncodeStats,
                   lapsed: bool, guard: PushGuard | None = None) -> int:
    """Check the chunks (see the module docstring), refuse if HEAD moved, then commit. Returns the manifest's size.

    lapsed: some rank's in-flight marker may have expired while it wrote, so check every chunk.
    """
    ensure_chunks(repo, man.files, stats, lapsed=lapsed, guard=guard)
    now = repo.head()
    if (now is None) != (head_seen is None) or (now is not None and head_seen is not None and now.digest != head_seen.digest):
        raise VersionConflictError(
            f"HEAD of {repo.url} moved to version {now.version if now else None} during this push; another writer is publishing"
        )
    return repo.commit(man)


def ensure_chunks(repo: Repository, files: Iterable[FileEntry], stats: EncodeStats, *, lapsed: bool,
                  timeout: float = GC_WAIT_SECONDS, guard: PushGuard | None = None) -> None:
    """Right before a manifest write: mark the push as committing, wait out a running gc, then check the chunks gc
    may have removed (FORMAT.md, "Pushes and gc").

    With a guard, its marker says "committing" from here until the push ends: a gc that reads the markers after
    that waits for the commit and then sees the manifest, whatever time the write takes; a gc that took its lock
    before is waited out here, and what it removed is found by the check. While a gc holds the lock the marker
    says "not committing" again (the gc would otherwise wait for this push as this push waits for it).
    """
    check = referenced_objects(files) if lapsed else set(stats.reused)
    if not check:
        return
    deadline = time.monotonic() + timeout
    waited = False
    while True:
        if guard is not None:
            guard.committing(True)
        holder = read_lock(repo.objects)
        if holder is None or is_stale(holder):
            break
        if guard is not None:
            guard.committing(False)
        if time.monotonic() > deadline:
            raise LockHeldError(f"a gc holds {repo.url} ({holder.describe()}); push again later")
        if not waited:
            log.warning("waiting for a gc of %s to finish before committing (%s; up to %.0fs)", repo.url,
                        holder.describe(), timeout)
            waited = True
        time.sleep(0.5)
    ids = sorted(check)
    missing = [oid for oid, ok in zip(ids, ordered_map(repo.has_chunk, ids, 8), strict=True) if not ok]
    if missing:
        raise ChunksGoneError(f"a gc removed {len(missing)} chunks this push references (e.g. {missing[0]})")


__all__ = ["GC_WAIT_SECONDS", "ChunksGoneError", "ReusedChunksGoneError", "commit_version", "ensure_chunks",
           "seal_manifest"]
