"""Folded deltas: an optional second manifest of version N encoded straight against its full version F.

A reader that has to start from F (a new or lagging host) would otherwise apply every delta
F+1 … N; with the fold it applies one. A fold (`folds/v{N:010d}.json`) is a manifest with N's
version number, files and digests, `kind: "delta"`, `parent: F`, `parent_digest: F.digest` and
`stats.fold_of: N.digest`. It is an accelerator: nothing needs it, a reader that cannot use it takes
the ordinary chain, and the version a reader installs is always N's own manifest.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from deltafs.errors import DeltafsError, ObjectNotFoundError
from deltafs.format.manifest import DELTA_CODECS, Manifest

if TYPE_CHECKING:
    from deltafs.read.rebuild import Chain
    from deltafs.store.repo import Repository

FOLD_PREFIX = "folds"


def fold_key(version: int) -> str:
    return f"{FOLD_PREFIX}/v{version:010d}.json"


def parse_fold_key(key: str) -> int | None:
    name = key.rsplit("/", 1)[-1]
    if not (key.startswith(FOLD_PREFIX + "/") and name.startswith("v") and name.endswith(".json")):
        return None
    digits = name[1:-5]
    return int(digits) if len(digits) == 10 and digits.isdigit() else None


def is_fold_of(fold: Manifest, target: Manifest) -> bool:
    """A fold is only usable for the exact version (digest) it was made for, with identical files."""
    return (fold.version == target.version and fold.store_id == target.store_id and fold.kind == "delta"
            and fold.stats.get("fold_of") == target.digest and fold.chunk_bytes == target.chunk_bytes
            and [(f.path, f.size, f.sha256) for f in fold.files] == [(f.path, f.size, f.sha256) for f in target.files])


def load_fold(repo: Repository, target: Manifest) -> Manifest | None:
    """The fold of `target`, or None if there is none or it is not usable (never an error)."""
    try:
        data = repo.objects.get(fold_key(target.version))
    except ObjectNotFoundError:
        return None
    except DeltafsError as exc:
        logging.getLogger("deltafs").warning("ignoring the fold of version %s: %s", target.version, exc)
        return None
    try:
        fold = Manifest.from_bytes(data, where=f"fold of version {target.version}")
    except DeltafsError as exc:
        logging.getLogger("deltafs").warning("ignoring the fold of version %s: %s", target.version, exc)
        return None
    return fold if is_fold_of(fold, target) else None


def chain_cost(steps: list[Manifest]) -> int:
    """Bytes of distinct objects a reader fetches to rebuild steps[-1] (per chunk, back to a self-contained record)."""
    if not steps:
        return 0
    per_step = [m.segments() for m in reversed(steps)]  # newest first
    needed: dict[str, int] = {}
    for key, (_f, seg) in per_step[0].items():
        for i in range(len(seg.chunks)):
            for segs in per_step:
                entry = segs.get(key)
                if entry is None or len(entry[1].chunks) <= i:
                    break
                rec = entry[1].chunks[i]
                if rec.object is not None:
                    needed[rec.object] = rec.stored
                if rec.name not in DELTA_CODECS:
                    break
    return sum(needed.values())


def prefer_fold(repo: Repository, chain: Chain) -> Chain:
    """Replace a chain F, F+1 … N by F, fold(N) when N has a usable fold that reads fewer bytes."""
    from deltafs.read.rebuild import Chain

    if chain.local is not None or len(chain.steps) < 3 or chain.final is not None:
        return chain
    full, target = chain.steps[0], chain.steps[-1]
    fold = load_fold(repo, target)
    if fold is None or fold.parent != full.version or fold.parent_digest != full.digest:
        return chain
    folded = [full, fold]
    if chain_cost(folded) < chain_cost(chain.steps):
        return Chain(folded, None, final=target)
    return chain


__all__ = ["FOLD_PREFIX", "chain_cost", "fold_key", "is_fold_of", "load_fold", "parse_fold_key", "prefer_fold"]
