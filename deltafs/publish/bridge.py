"""A keyframe's bridge: the full version encoded again as a delta against its parent (deltafs.read.chain).

A full version (the first one, `--full`, or one the keyframe policy asks for) makes every host that holds its
parent read the whole checkpoint again, although the trainer changed ~1% of it. The bridge lets those hosts
apply one delta instead, while new hosts still start from the full version. Each rank encodes its files against
its push cache (the parent's bytes) right after the full encode, before the cache moves on; the root writes the
bridge manifest after its chunks and before the version's own manifest, so a host that sees the version can
already use its bridge. A bridge is an accelerator: one that cannot be made is skipped with a warning, and the
version is committed as it would be without it.
"""

from __future__ import annotations

import logging

from deltafs.errors import DeltafsError
from deltafs.format.keys import bridge_key
from deltafs.format.manifest import FileEntry, Manifest
from deltafs.publish.commit import accelerator_manifest, ensure_chunks
from deltafs.publish.encode import EncodeStats, Encoder
from deltafs.publish.source import SourceFile
from deltafs.store.accelerators import is_bridge_of
from deltafs.read.dest import LocalState
from deltafs.store.lock import PushGuard
from deltafs.store.repo import Repository

log = logging.getLogger("deltafs")


def encode_bridge_part(repo: Repository, base: LocalState, files: list[SourceFile], *, level: int,
                       full_level: int, threads: int) -> tuple[list[FileEntry], EncodeStats] | None:
    """This rank's files encoded against its base (the parent version), chunks written; None if that failed."""
    enc = Encoder(repo, base, level=level, full_level=full_level, threads=threads, stage_dir=None)
    try:
        return enc.encode(files), enc.stats
    except (DeltafsError, OSError) as exc:
        log.warning("no bridge: encoding the full version against version %s failed: %s", base.version, exc)
        return None


def write_bridge(repo: Repository, man: Manifest, files: list[FileEntry], stats: EncodeStats, *,
                 lapsed: bool, guard: PushGuard | None = None) -> int:
    """Root, before `man` (a full version) is committed: its bridge manifest, after its chunks. Returns bytes written.

    Written with a plain put: a bridge left by a push of the same version number that never committed names
    another digest and is replaced (readers ignore a bridge whose `bridge_of` is not the version's digest).
    """
    if man.parent is None or man.parent_digest is None:
        raise DeltafsError(f"version {man.version} has no parent to bridge from")
    bridge = accelerator_manifest(man, man.parent, man.parent_digest, files, stats, role="bridge_of",
                                  created=man.created)
    if not is_bridge_of(bridge, man):
        raise DeltafsError("the bridge's files differ from the full version's (a source changed during the push)")
    ensure_chunks(repo, bridge.files, stats, lapsed=lapsed, guard=guard)
    data = bridge.encode()
    repo.objects.put(bridge_key(man.version), data)
    return stats.stored + len(data)


__all__ = ["encode_bridge_part", "write_bridge"]
