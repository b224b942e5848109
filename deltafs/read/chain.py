"""Plan how to reach a version: walk parents back to the local base or a full version, and use a fold when cheaper.

A folded delta (`folds/v{N:010d}.json`) is an optional second manifest of version N encoded
straight against its full version F: `kind: "delta"`, `parent: F`, `parent_digest: F.digest` and
`stats.fold_of: N.digest`, with N's version number, files and digests. A reader that has to start
from F (a new or lagging host) applies one delta instead of every delta F+1 … N. It is an
accelerator: nothing needs it, a reader that cannot use it takes the ordinary chain, and the
version a reader installs is always N's own manifest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from deltafs.errors import DeltafsError, IntegrityError, ObjectNotFoundError
from deltafs.format.keys import FOLD_PREFIX, fold_key, parse_fold_key
from deltafs.format.manifest import DELTA_CODECS, Manifest
from deltafs.format.records import MANIFEST_MAX_BYTES
from deltafs.read.dest import LocalState
from deltafs.store.repo import Repository

log = logging.getLogger("deltafs")


@dataclass
class Chain:
    """How to reach a target version: start from the local base (if any), then apply steps in order."""

    steps: list[Manifest]  # oldest first; the last one is the target (or its fold, see final)
    local: LocalState | None  # the base the first step applies to; None when the chain starts at a full version
    final: Manifest | None = None  # the target's own manifest when the last step is a fold

    @property
    def target(self) -> Manifest:
        return self.final if self.final is not None else self.steps[-1]


def plan_chain(repo: Repository, target: int, local: LocalState | None, *, folds: bool = False) -> Chain:
    """Walk parents back from target until the local version or a full version; the cheaper path by bytes.

    Any full version on the way makes a chain that crosses it no cheaper than starting there, so
    stopping at the first full version or at the local base is the cheapest plan. With folds=True a
    chain that starts at a full version may be shortened to [full, fold of target].
    """
    steps: list[Manifest] = []
    man = repo.manifest(target)
    while True:
        if local is not None and man.version == local.version and man.digest == local.digest:
            steps.reverse()
            return Chain(steps, local)
        steps.append(man)
        if man.kind == "full":
            steps.reverse()
            chain = Chain(steps, None)
            return prefer_fold(repo, chain) if folds else chain
        if man.parent is None:
            raise IntegrityError(f"version {man.version} is a delta without a parent")
        parent = repo.manifest(man.parent)
        if parent.digest != man.parent_digest:
            raise IntegrityError(
                f"version {man.version} was made against another version {man.parent} (base digest mismatch)",
                expected=man.parent_digest,
                actual=parent.digest,
            )
        man = parent


# --- folds -----------------------------------------------------------------------------------------
def is_fold_of(fold: Manifest, target: Manifest) -> bool:
    """A fold is only usable for the exact version (digest) it was made for, with identical files."""
    return (fold.version == target.version and fold.store_id == target.store_id and fold.kind == "delta"
            and fold.stats.get("fold_of") == target.digest and fold.chunk_bytes == target.chunk_bytes
            and [(f.path, f.size, f.digest) for f in fold.files] == [(f.path, f.size, f.digest) for f in target.files])


def load_fold(repo: Repository, target: Manifest) -> Manifest | None:
    """The fold of `target`, or None if there is none or it is not usable (never an error)."""
    try:
        data = repo.objects.get(fold_key(target.version), limit=MANIFEST_MAX_BYTES)
        fold = repo.check_manifest(Manifest.decode(data, where=f"fold of version {target.version}"),
                                   target.version, "fold")
    except ObjectNotFoundError:
        return None
    except DeltafsError as exc:
        log.warning("ignoring the fold of version %s: %s", target.version, exc)
        return None
    return fold if is_fold_of(fold, target) else None


def chain_objects(steps: list[Manifest], *, skip_files: frozenset[str] = frozenset()) -> dict[str, int]:
    """Distinct objects (id -> object size: a pack is fetched whole) a reader fetches to rebuild steps[-1], per chunk
    back to a self-contained record; files in skip_files are not rebuilt (linked from a local copy)."""
    if not steps:
        return {}
    per_step = [m.segments() for m in reversed(steps)]  # newest first
    needed: dict[str, int] = {}
    for key, (f, seg) in per_step[0].items():
        if f.path in skip_files:
            continue
        for i in range(len(seg.chunks)):
            for segs in per_step:
                entry = segs.get(key)
                if entry is None or len(entry[1].chunks) <= i:
                    break
                rec = entry[1].chunks[i]
                if rec.object is not None:
                    needed[rec.object] = rec.object_bytes
                if rec.name not in DELTA_CODECS:
                    break
    return needed


def chain_cost(steps: list[Manifest]) -> int:
    """Bytes of distinct objects a reader fetches to rebuild steps[-1] (per chunk, back to a self-contained record)."""
    return sum(chain_objects(steps).values())


def prefer_fold(repo: Repository, chain: Chain) -> Chain:
    """Replace a chain F, F+1 … N by F, fold(N) when N has a usable fold that reads fewer bytes."""
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


__all__ = ["FOLD_PREFIX", "Chain", "chain_cost", "chain_objects", "fold_key", "is_fold_of", "load_fold", "parse_fold_key", "plan_chain",
           "prefer_fold"]
