"""Before any chunk is written: the new version's number and kind, and a valid base to encode against.

The base is the push cache: a deltafs-managed local copy of the store's HEAD version (laid out like a
pull DEST, deltafs.read.dest). A cache that is missing, stale (another writer, a restarted trainer,
a new world size) or corrupt is re-derived from the store, so a delta is only ever encoded against
bytes that readers can rebuild. A rank of a multi-rank push keeps (and re-derives) only the files of
HEAD that its own segments came from.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, replace

from deltafs.errors import UsageError
from deltafs.format.manifest import Head, Manifest
from deltafs.publish.options import PushOptions
from deltafs.read.dest import LocalCheckpoint, LocalState
from deltafs.format.versions import check_version
from deltafs.read.chain import Chain, plan_chain
from deltafs.read.pull import checked_head
from deltafs.read.rebuild import Builder, ChunkSource
from deltafs.store.repo import Repository


@dataclass(frozen=True)
class Decision:
    """The root rank's decision, the same on every rank."""

    store_id: str
    head: Head | None
    version: int
    kind: str  # "full" | "delta"
    bridge: bool = False  # a full version with a parent: also encode it against the parent (deltafs.publish.bridge)
    # Write the fold after the commit: the root's fold=, as full= and the keyframe options are (folding is two
    # collectives: a rank that skipped them met the other ranks' next push out of step, and a version mixed steps).
    fold: bool = False


def decide(repo: Repository, opts: PushOptions, full_bytes: int) -> Decision:
    """The new version's number (HEAD + 1 unless given) and kind (full when the keyframe policy says so)."""
    head = checked_head(repo)  # a HEAD naming a missing or different manifest is reported as such
    if opts.version is not None and head is not None and opts.version <= head.version:
        raise UsageError(f"version {opts.version} is not newer than the store's newest version {head.version}")
    version = check_version(opts.version if opts.version is not None else (head.version + 1 if head else 1))
    parent = repo.manifest(head.version) if head is not None else None
    due = parent is None or opts.full or keyframe_due(parent, full_bytes, opts.keyframe_every, opts.keyframe_budget)
    return Decision(repo.store_id, head, version, "full" if due else "delta", bridge=due and parent is not None and opts.bridge,
                    fold=opts.fold)


def keyframe_due(parent: Manifest, full_bytes: int, every: int | None, budget: float | None) -> bool:
    """A full version is due after `every` versions, or once the deltas since the last one reach budget x full."""
    since = parent.count("since_full")
    if every is not None and every > 0 and since + 1 >= every:
        return True
    chain = parent.count("chain_bytes")
    return budget is not None and budget > 0 and chain >= budget * full_bytes


def default_cache_dir(store_id: str) -> str:
    root = os.environ.get("DELTAFS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "deltafs")
    return os.path.join(root, "push", store_id)


def base_for(repo: Repository, cache: LocalCheckpoint, target: Manifest, keys: set[str], *,
             rederive: bool = False) -> tuple[LocalState, bool]:
    """The cache as a base for the segments `keys` at version `target`; rebuilt from the store if it is not.

    Returns the state and whether it was rebuilt. Only the files of target that hold one of `keys`
    are needed (and rebuilt, each digest verified).
    """
    state = None if rederive else cached_base(repo, cache, target, keys)
    if state is not None:
        return state, False
    needed = sorted({f.path for key, (f, _seg) in target.segments().items() if key in keys})
    chain = plan_chain(repo, target.version, None)
    wanted = set(needed)
    only = replace(target, files=tuple(f for f in target.files if f.path in wanted))  # the digest stays target's
    staging = cache.new_staging()
    try:
        Builder(repo, Chain(chain.steps[:-1] + [only], None), ChunkSource(repo, None)).build(staging)
        cache.install(staging, store_id=repo.store_id, store_url=repo.url, manifest=target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    cache.cleanup(keep=1)
    new_state = cache.state()
    assert new_state is not None
    return new_state, True


def cached_base(repo: Repository, cache: LocalCheckpoint, target: Manifest, keys: set[str]) -> LocalState | None:
    """The cache's state if it holds version `target` of this store with every file that holds one of `keys`."""
    needed = {f.path for key, (f, _seg) in target.segments().items() if key in keys}
    state = cache.state()
    if state is not None and state.store_id == repo.store_id and state.version == target.version \
            and state.digest == target.digest and all(os.path.isfile(os.path.join(state.path, p)) for p in needed):
        return state
    return None


def drop_cache(cache: LocalCheckpoint) -> None:
    """Forget the cache (the next push re-derives it from the store)."""
    if os.path.islink(cache.dest):
        os.unlink(cache.dest)
    cache.cleanup(keep=0)


__all__ = ["Decision", "base_for", "cached_base", "decide", "default_cache_dir", "drop_cache", "keyframe_due"]
