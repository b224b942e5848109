"""After a commit: a folded delta from the last full version straight to the new one (deltafs.read.chain).

Each rank keeps a keyframe cache (a local copy of the last full version, hard links of its push cache
when it pushed that version itself), encodes its own files against it, and the root writes the fold
manifest from every rank's entries. The version is already committed: a fold that cannot be written
is logged and skipped.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from deltafs.errors import DeltafsError
from deltafs.format.manifest import FileEntry, Manifest
from deltafs.publish.commit import accelerator_manifest, ensure_chunks
from deltafs.publish.encode import EncodeStats, Encoder
from deltafs.publish.plan import base_for, drop_cache
from deltafs.publish.source import SourceFile
from deltafs.read.dest import LocalCheckpoint, LocalState
from deltafs.format.records import utcnow
from deltafs.format.keys import fold_key
from deltafs.read.chain import plan_chain
from deltafs.store.accelerators import is_fold_of
from deltafs.read.rebuild import LocalBaseError
from deltafs.store.lock import PushGuard
from deltafs.store.repo import Repository


@dataclass
class FoldPart:
    """One rank's share of a fold: its file entries against the full version, and what it wrote."""

    files: list[dict[str, object]]
    stats: EncodeStats
    lapsed: bool = False  # the rank's in-flight marker may have lapsed while it wrote: gc may have removed them


def fold_needed(man: Manifest) -> bool:
    """Only a delta two or more steps past its full version has a chain worth folding."""
    return man.kind == "delta" and man.count("since_full") >= 2


def encode_fold_part(repo: Repository, man: Manifest, base: LocalState, keyframe: LocalCheckpoint,
                     files: list[SourceFile], *, level: int, threads: int, full_level: int | None = None) -> FoldPart | None:
    """Keep the keyframe cache current and, when a fold is due, encode `files` against the full version."""
    if man.kind == "full":
        link_keyframe(repo, base, keyframe)
        return None
    if not fold_needed(man) or not files:
        return FoldPart([], EncodeStats()) if fold_needed(man) else None
    full = plan_chain(repo, man.version, None).steps[0]
    kstate, _ = base_for(repo, keyframe, full, {seg.key for f in files for seg in f.segments})
    enc = Encoder(repo, kstate, level=level, full_level=full_level, threads=threads, stage_dir=None)
    try:
        entries = enc.encode(files)
    except LocalBaseError:
        drop_cache(keyframe)  # rebuilt from the store next time
        raise
    return FoldPart([e.to_json() for e in entries], enc.stats)


def write_fold(repo: Repository, man: Manifest, parts: list[FoldPart], guard: PushGuard | None = None) -> int:
    """Root: the fold manifest from every rank's part, after its chunks. Returns the bytes written."""
    full = plan_chain(repo, man.version, None).steps[0]
    stats = EncodeStats()
    for p in parts:
        stats.add(p.stats)
    folded = accelerator_manifest(man, full.version, full.digest, (FileEntry.from_json(f) for p in parts for f in p.files),
                                  stats, role="fold_of", created=utcnow())
    if not is_fold_of(folded, man):
        raise DeltafsError("the source changed after the version was committed")
    # Each rank's marker kept its new chunks from a gc, unless one lapsed (a process frozen meanwhile): then all.
    lapsed = any(p.lapsed for p in parts) or (guard is not None and guard.lapsed)
    ensure_chunks(repo, folded.files, stats, lapsed=lapsed, guard=guard)
    data = folded.encode()
    repo.objects.put_if_absent(fold_key(man.version), data)  # after its chunks, like a commit
    return stats.stored + len(data)


def link_keyframe(repo: Repository, state: LocalState, keyframe: LocalCheckpoint) -> None:
    """Make the keyframe cache a copy of the full version just pushed (hard links: no extra disk)."""
    staging = keyframe.new_staging()
    try:
        for f in state.manifest.files:
            src, dst = os.path.join(state.path, f.path), os.path.join(staging, f.path)
            if not os.path.isfile(src):
                continue  # a rank's cache holds only its own files
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copyfile(src, dst)
        keyframe.install(staging, store_id=repo.store_id, store_url=repo.url, manifest=state.manifest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    keyframe.cleanup(keep=1)


__all__ = ["FoldPart", "encode_fold_part", "fold_needed", "link_keyframe", "write_fold"]
