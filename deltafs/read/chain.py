"""Plan how to reach a version: walk parents back to the local base or a full version, and use a fold when cheaper.

A folded delta (`folds/v{N:010d}.json`) is an optional second manifest of version N encoded
straight against its full version F: `kind: "delta"`, `parent: F`, `parent_digest: F.digest` and
`stats.fold_of: N.digest`, with N's version number, files and digests. A reader that has to start
from F (a new or lagging host) applies one delta instead of every delta F+1 … N. It is an
accelerator: nothing needs it, a reader that cannot use it takes the ordinary chain, and the
version a reader installs is always N's own manifest.

A bridge (`bridges/v{N:010d}.json`) is the other accelerator: full version N (a keyframe) encoded
as a delta against its parent P, with `stats.bridge_of: N.digest`. A host whose chain reaches P
crosses the keyframe by the bridge instead of reading N's full chunks, when that reads fewer bytes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from deltafs.errors import DeltafsError, IntegrityError, VersionNotFoundError
from deltafs.format.manifest import DELTA_CODECS, Manifest
from deltafs.read.dest import LocalState
from deltafs.store.accelerators import load_bridge, load_fold
from deltafs.store.repo import Repository

log = logging.getLogger("deltafs")

# How many keyframes a reader's chain may cross by their bridges. Each keyframe period holds at most about one
# full version's worth of deltas (the keyframe budget), so crossing more rarely reads fewer bytes than starting
# at the newest full version, and every crossing walks another period's manifests.
MAX_BRIDGES = 3


@dataclass
class Chain:
    """How to reach a target version: start from the local base (if any), then apply steps in order."""

    steps: list[Manifest]  # oldest first; the last one is the target (or its fold, see final)
    local: LocalState | None  # the base the first step applies to; None when the chain starts at a full version
    final: Manifest | None = None  # the target's own manifest when the last step is a fold
    # What DEST holds when the chain does not start from it (local is None): its files equal to the target's are
    # hard-linked after a re-hash instead of rebuilt (a pull that crosses a full version re-read unchanged files).
    link: LocalState | None = None

    @property
    def target(self) -> Manifest:
        return self.final if self.final is not None else self.steps[-1]


def plan_chain(repo: Repository, target: int, local: LocalState | None, *, folds: bool = False,
               bridges: int = 0) -> Chain:
    """Walk parents back from target until the local version or a full version; the cheaper path by bytes.

    Without bridges, any full version on the way makes a chain that crosses it no cheaper than
    starting there, so stopping at the first full version or at the local base is the cheapest plan.
    With folds=True a chain that starts at a full version may be shortened to [full, fold of target].
    With bridges > 0 and a local base older than that full version, the chain may instead go on
    from the local base and cross the full version by its bridge, when that reads fewer bytes (up to
    `bridges` full versions are crossed so).
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
            chain = prefer_fold(repo, chain) if folds else chain
            crossed = cross_by_bridge(repo, steps, local, bridges) if bridges > 0 and local is not None else None
            if crossed is not None and chain_cost(crossed.steps) < chain_cost(chain.steps):
                return crossed
            return chain
        if man.parent is None:
            raise IntegrityError(f"version {man.version} is a delta without a parent")
        if local is not None and man.parent == local.version and man.parent_digest == local.digest:
            steps.reverse()  # DEST holds the parent: its manifest is in DEST's state (the store's may be gone)
            return Chain(steps, local)
        try:
            parent = repo.manifest(man.parent)
        except VersionNotFoundError:
            # Said about the version asked for: "version 12 is not in STORE" (exit 4) for a pull of 14 read as if
            # 14 were missing. A chain with a hole is a damaged store.
            raise IntegrityError(f"version {target} cannot be rebuilt: version {man.parent}, the parent of version "
                                 f"{man.version}, is missing from the store; run 'deltafs verify --all'") from None
        if parent.digest != man.parent_digest:
            raise IntegrityError(
                f"version {man.version} was made against another version {man.parent} (base digest mismatch)",
                expected=man.parent_digest,
                actual=parent.digest,
            )
        man = parent


# --- folds -----------------------------------------------------------------------------------------
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


# --- bridges -------------------------------------------------------------------------------
def cross_by_bridge(repo: Repository, steps: list[Manifest], local: LocalState, bridges: int = 1) -> Chain | None:
    """steps = [F, F+1 … N] from full version F: the chain local … parent of F, bridge of F, F+1 … N, or None
    when F has no usable bridge or its parent's chain does not lead back to the local base (up to bridges - 1
    older keyframes are crossed the same way, each only where that is cheaper)."""
    full = steps[0]
    if local.version >= full.version or full.parent is None:
        return None
    bridge = load_bridge(repo, full)
    if bridge is None:
        return None
    if local.version == full.parent and local.digest == full.parent_digest:
        below = Chain([], local)  # the host holds the parent itself: its manifest may be gone from the store
    else:
        try:
            below = plan_chain(repo, full.parent, local, bridges=bridges - 1)
        except DeltafsError as exc:
            log.info("not crossing version %s by its bridge: %s", full.version, exc)
            return None
    if below.local is None:
        return None  # the parent is reached from a full version anyway: no cheaper than starting at F
    # below.final (the parent is itself a full version, crossed by its own bridge) only matters for a chain that
    # ends there: here the parent is a step on the way.
    return Chain(below.steps + [bridge] + steps[1:], local, final=full if len(steps) == 1 else None)


__all__ = ["MAX_BRIDGES", "Chain", "chain_cost", "chain_objects", "cross_by_bridge", "plan_chain", "prefer_fold"]
