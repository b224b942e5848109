"""Retention: plan which versions to keep, then delete the other manifests and every unreferenced chunk.

Rules (FORMAT.md, "gc and locking"):
- Kept: the newest `keep_last` versions, the newest `keep_full` full versions, HEAD, and every
  version that stopped being HEAD less than `grace` seconds ago (a reader that read HEAD then is
  still pulling it); plus, for each of those, its chain back to its full version.
- A chunk is deleted only if no kept version references it AND the object is older than `grace`
  seconds AND it was written before every push in flight began: a push in flight has written
  chunks its manifest does not reference yet, however long it has been running. A push announces
  itself with a marker (locks/push-<id>.json, deltafs.store.lock.PushGuard) that it rewrites while
  it runs; a marker not rewritten for its ttl is a dead push's, and gc removes it.
- One gc at a time: `locks/gc.json`, created with put_if_absent; a stale lock (dead pid on this
  host, or older than its stale age) is taken over.
- Order: manifests newest first, then chunks. A gc killed at any point leaves a store in which
  every remaining manifest's chain and chunks are intact; what is left over is unreferenced
  garbage that the next gc removes.
- Before deleting chunks, the manifest listing is read again: versions committed while gc ran
  keep their chunks (and their chains).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from deltafs.defaults import DEFAULT_GRACE
from deltafs.errors import (
    DeltafsError,
    FormatError,
    IntegrityError,
    LockHeldError,
    ObjectNotFoundError,
    StoreError,
    UsageError,
)
from deltafs.format.keys import (BRIDGE_PREFIX, FOLD_PREFIX, bridge_key, fold_key, parse_bridge_key, parse_chunk_key,
                                 parse_fold_key)
from deltafs.read.chain import plan_chain
from deltafs.store.accelerators import load_bridge, load_fold
from deltafs.format.manifest import Manifest, chunk_key, manifest_key, parse_manifest_key, referenced_objects
from deltafs.format.versions import MAX_VERSION
from deltafs.store.lock import DEFAULT_STALE_AFTER, StoreLock, read_push_markers
from deltafs.parallel import ordered_map
from deltafs.format.records import parse_timestamp
from deltafs.store.base import ObjectStore
from deltafs.store.repo import Repository

# gc waits at least this long between taking its lock and its last look at the manifests, so that a
# push which checked for the lock just before gc took it has committed by then (see publish.py).
DEFAULT_SETTLE = 2.0


@dataclass
class GcPlan:
    store: str
    versions: list[int]  # every version seen when planning
    keep: dict[int, str]  # kept version -> why ("head", "last", "full", "recent", "chain of N", "new")
    remove: list[int]  # versions whose manifests go, newest first
    chunks: dict[str, int]  # chunk object id -> size, for the chunks that go
    manifest_bytes: dict[int, int] = field(default_factory=dict)  # size of each removed manifest
    chunks_referenced: int = 0
    chunks_too_young: int = 0  # unreferenced, but written less than `grace` ago (a push in flight?)
    chunks_in_flight: int = 0  # unreferenced, but written since a live push began (its marker protects them)
    push_markers: list[str] = field(default_factory=list)  # live in-flight push markers seen
    dead_markers: list[str] = field(default_factory=list)  # markers of dead pushes, removed with the chunks
    chunk_mtimes: dict[str, float] = field(default_factory=dict)  # mtime of each chunk that goes
    temp_files: dict[str, int] = field(default_factory=dict)  # local stores: partial writes of killed processes
    folds: dict[int, int] = field(default_factory=dict)  # folded deltas that go: version -> size
    bridges: dict[int, int] = field(default_factory=dict)  # keyframe bridges that go: version -> size
    grace: float = DEFAULT_GRACE

    @property
    def bytes_freed(self) -> int:
        return (sum(self.chunks.values()) + sum(self.manifest_bytes.get(v, 0) for v in self.remove)
                + sum(self.temp_files.values()) + sum(self.folds.values()) + sum(self.bridges.values()))

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["keep"] = {str(k): v for k, v in sorted(self.keep.items())}
        out["manifest_bytes"] = {str(k): v for k, v in sorted(self.manifest_bytes.items())}
        out["folds"] = {str(k): v for k, v in sorted(self.folds.items())}
        out["bridges"] = {str(k): v for k, v in sorted(self.bridges.items())}
        out["bytes_freed"] = self.bytes_freed
        del out["chunk_mtimes"]
        return out


@dataclass
class GcResult:
    plan: GcPlan
    executed: bool
    versions_removed: list[int] = field(default_factory=list)
    chunks_removed: int = 0
    bytes_freed: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["plan"] = self.plan.to_json()
        return out


def gc(store: str | Repository, *, keep_last: int, keep_full: int = 0, grace: float = DEFAULT_GRACE,
       dry_run: bool = False, wait: float = 0.0, storage_options: dict[str, Any] | None = None,
       settle: float = DEFAULT_SETTLE, stale_after: float = DEFAULT_STALE_AFTER, threads: int = 8,
       on_delete: Callable[[str], None] | None = None) -> GcResult:
    """Plan, then (unless dry_run) execute a gc under the store's gc lock. See the module docstring."""
    if keep_last < 1:
        raise UsageError("--keep-last must be at least 1 (HEAD's version is always kept)")
    if keep_full < 0:
        raise UsageError(f"--keep-full cannot be negative, got {keep_full}")
    if not grace >= 0 or grace == float("inf"):  # `not >=` also refuses NaN
        raise UsageError(f"--grace must be a finite number of seconds >= 0, got {grace}")
    t0 = time.monotonic()
    repo = store if isinstance(store, Repository) else Repository.open(store, storage_options)
    if dry_run:
        plan = make_plan(repo, keep_last=keep_last, keep_full=keep_full, grace=grace)
        return GcResult(plan, executed=False, bytes_freed=plan.bytes_freed, seconds=time.monotonic() - t0)
    lock = StoreLock(repo.objects, purpose="gc", stale_after=stale_after)
    with lock.hold(wait=wait):
        locked_at = time.monotonic()
        plan = make_plan(repo, keep_last=keep_last, keep_full=keep_full, grace=grace)
        result = _execute(repo, plan, locked_at=locked_at, settle=settle, threads=threads, on_delete=on_delete,
                          lock=lock)
    result.seconds = time.monotonic() - t0
    return result


def make_plan(repo: Repository, *, keep_last: int, keep_full: int = 0, grace: float = DEFAULT_GRACE,
              now: float | None = None) -> GcPlan:
    """Decide what goes. Reads manifests and the chunk listing; changes nothing."""
    now = time.time() if now is None else now
    _refuse_unplaceable(repo)
    versions = repo.versions()
    plan = GcPlan(repo.url, versions, {}, [], {}, grace=grace)
    if not versions:
        return plan
    manifests = {v: _manifest(repo, v) for v in versions}
    head = repo.read_head()
    roots: dict[int, str] = {}
    for v in versions[-keep_last:]:
        roots[v] = "last"
    fulls = [v for v in versions if manifests[v].kind == "full"]
    for v in fulls[-keep_full:] if keep_full else []:
        roots.setdefault(v, "full")
    # A version read as HEAD less than `grace` ago may still be being pulled: it stopped being HEAD
    # when its successor was committed.
    for older, newer in zip(versions, versions[1:], strict=False):
        if now - _created(manifests[newer]) < grace:
            roots.setdefault(older, "recent")
    roots[versions[-1]] = "head"
    if head is not None and head.version in manifests:
        roots[head.version] = "head"
    keep: dict[int, str] = {}
    for v, why in sorted(roots.items()):
        keep.setdefault(v, why)
        for step in _chain(repo, v):
            keep.setdefault(step.version, f"chain of {v}")
    plan.keep = keep
    plan.remove = sorted((v for v in versions if v not in keep), reverse=True)
    referenced = referenced_objects(f for v in keep for f in manifests[v].files)
    for v, key in _fold_keys(repo):
        fold = _load(load_fold, repo, manifests[v], key) if v in keep else None
        if fold is not None:
            referenced |= referenced_objects(fold.files)
        else:  # the fold of a removed version, or one that is unusable anyway
            _plan_removal(repo, key, v, plan.folds)
    for v, key in _bridge_keys(repo):
        if v > versions[-1]:
            # A push writes its bridge before its manifest: in flight (or left by a push that died, which the
            # next push of that version replaces, and which goes once the version exists and it does not match).
            continue
        # A kept full version keeps its bridge even when its parent goes: a host that holds the parent can use it.
        bridge = _load(load_bridge, repo, manifests[v], key) if v in keep else None
        if bridge is not None:
            referenced |= referenced_objects(bridge.files)
        else:  # the bridge of a removed version, or one that is unusable anyway
            _plan_removal(repo, key, v, plan.bridges)
    plan.chunks_referenced = len(referenced)
    plan.manifest_bytes = {v: repo.manifest_size(v) for v in plan.remove}
    protect_since = _read_markers(repo, plan, now)  # before the chunk listing: a push starting later writes after it
    for key in repo.objects.list("chunks"):
        oid = parse_chunk_key(key)
        if oid is None or oid in referenced:
            continue  # not a chunk object (a foreign file: never touched, as FORMAT.md says), or still needed
        try:
            size, mtime = stat(repo.objects, key)
        except ObjectNotFoundError:
            continue  # gone since the listing (another gc)
        if grace > 0 and (mtime is None or now - mtime < grace):
            plan.chunks_too_young += 1
            continue
        if protect_since < float("inf") and (mtime is None or mtime >= protect_since):
            plan.chunks_in_flight += 1
            continue
        plan.chunks[oid] = size
        plan.chunk_mtimes[oid] = mtime if mtime is not None else float("inf")
    # partial writes of killed writers (local stores), but not one a live push may still be writing
    plan.temp_files = repo.objects.leftovers(older_than=grace, written_before=protect_since)
    return plan


def _read_markers(repo: Repository, plan: GcPlan, now: float) -> float:
    """Record live and dead push markers; return the time since which chunks may belong to a live push."""
    since = float("inf")
    plan.push_markers, plan.dead_markers = [], []
    for marker in read_push_markers(repo.objects):
        if marker.live(now):
            plan.push_markers.append(marker.key)
            since = min(since, marker.protects_since)
        else:
            plan.dead_markers.append(marker.key)
    return since


def _refuse_unplaceable(repo: Repository) -> None:
    """Stop before deleting anything if manifests/ holds an object gc cannot place as a version.

    Such a manifest's chunks would look unreferenced and be deleted (a 13-digit version written by an
    older deltafs, say): losing data is worse than not collecting garbage.
    """
    for key in repo.objects.list("manifests"):
        if parse_manifest_key(key) is None:
            raise FormatError(f"gc stopped: {key} is not a manifest name deltafs can place (versions are "
                              f"0..{MAX_VERSION}); its chunks could be lost. Move it out of the store, then run gc again")


def _manifest(repo: Repository, version: int) -> Manifest:
    """A manifest, or FormatError naming it: gc never plans around one it cannot read."""
    try:
        return repo.manifest(version)
    except DeltafsError as exc:
        if isinstance(exc, StoreError) and not isinstance(exc, ObjectNotFoundError):
            # The store stopped answering while gc planned (nothing is removed before the plan is whole): not a
            # damaged store, so not "run verify" (exit 3, as any store outage).
            raise StoreError(f"gc stopped before removing anything: the manifest of version {version} cannot be "
                             f"read ({exc})") from None
        raise FormatError(f"gc stopped: the manifest of version {version} cannot be read ({exc}); "
                          "run 'deltafs verify --all'") from None


# gc checks that its lock is still its own before each batch of this many chunk deletions (StoreLock.check_held).
DELETE_BATCH = 256


def _execute(repo: Repository, plan: GcPlan, *, locked_at: float, settle: float, threads: int,
             on_delete: Callable[[str], None] | None, lock: StoreLock) -> GcResult:
    result = GcResult(plan, executed=True)
    _absorb_new_versions(repo, plan)
    lock.check_held()
    for v in sorted(plan.folds, reverse=True):  # folds first: no fold outlives its version
        if on_delete:
            on_delete(fold_key(v))
        repo.objects.delete(fold_key(v))
    for v in sorted(plan.bridges, reverse=True):  # and bridges
        if on_delete:
            on_delete(bridge_key(v))
        repo.objects.delete(bridge_key(v))
    for v in plan.remove:  # newest first: an older removed version never loses its own chain first
        lock.check_held()
        key = manifest_key(v)
        if on_delete:
            on_delete(key)
        repo.objects.delete(key)
        result.versions_removed.append(v)
    # Last look at the manifests, no sooner than `settle` after taking the lock (see DEFAULT_SETTLE), and after every
    # push that marked itself committing has committed (it checked its chunks before this gc took its lock).
    time.sleep(max(0.0, settle - (time.monotonic() - locked_at)))
    _wait_for_commits(repo, plan)
    # ... and at the pushes: one that began since planning (or whose marker came back) keeps its chunks.
    since = _read_markers(repo, plan, time.time())
    spared = [oid for oid, mtime in plan.chunk_mtimes.items() if mtime >= since and oid in plan.chunks]
    for oid in spared:
        del plan.chunks[oid]
    plan.chunks_in_flight += len(spared)

    def delete(oid: str) -> None:
        key = chunk_key(oid)
        if on_delete:
            on_delete(key)
        repo.objects.delete(key)

    doomed = list(plan.chunks)
    for start in range(0, len(doomed), DELETE_BATCH):
        lock.check_held()  # a push that sees no gc lock commits: never delete after losing it
        for _ in ordered_map(delete, doomed[start:start + DELETE_BATCH], threads):
            result.chunks_removed += 1
    for name in plan.temp_files:
        repo.objects.remove_leftover(name)
    for key in plan.dead_markers:
        if on_delete:
            on_delete(key)
        repo.objects.delete(key)
    result.bytes_freed = plan.bytes_freed
    return result


COMMIT_WAIT = 120.0  # how long gc waits for pushes that are committing before it gives up (exit 8), deleting no chunk


def _wait_for_commits(repo: Repository, plan: GcPlan, wait: float = COMMIT_WAIT) -> None:
    """Absorb the versions committed since planning, once no live push marker says "committing".

    A push marks itself committing before it checks the gc lock and its reused chunks, and keeps the mark until it
    ends; a push that sees this gc's lock unmarks itself and waits. So a marked push checked its chunks before this
    gc took its lock, and its manifest (which may be slow to write, or its process frozen) is seen here once it
    is written: waiting for it is what keeps its reused chunks (FORMAT.md, "Pushes and gc").
    """
    deadline = time.monotonic() + wait
    while True:
        _absorb_new_versions(repo, plan)
        now = time.time()
        committing = [m for m in read_push_markers(repo.objects) if m.committing and m.live(now)]
        if not committing:
            return
        if time.monotonic() > deadline:
            raise LockHeldError(f"gc stopped before removing chunks: a push has been committing to {repo.url} for "
                                f"more than {wait:.0f}s (pid {committing[0].pid} on {committing[0].host}); run gc "
                                "again later")
        time.sleep(0.5)


def _absorb_new_versions(repo: Repository, plan: GcPlan) -> None:
    """Versions committed since planning keep their chains and chunks."""
    known = set(plan.versions)
    new = [v for v in repo.versions() if v not in known]
    for v in new:
        steps = _chain(repo, v)
        needed = referenced_objects(f for m in steps for f in m.files)
        for step in steps:
            plan.keep.setdefault(step.version, "new" if step.version == v else f"chain of {v}")
        plan.remove = [r for r in plan.remove if r not in plan.keep]
        plan.chunks = {c: n for c, n in plan.chunks.items() if c not in needed}
        plan.versions.append(v)
    # Folds written since planning (a push writes its fold just after its commit) and bridges of versions committed
    # since planning (written just before their manifests) keep their chunks.
    for keys, load, going in ((_fold_keys, load_fold, plan.folds), (_bridge_keys, load_bridge, plan.bridges)):
        for v, key in keys(repo):
            if v in plan.keep and v not in going:
                extra = _load(load, repo, repo.manifest(v), key)
                if extra is not None:
                    needed = referenced_objects(extra.files)
                    plan.chunks = {c: n for c, n in plan.chunks.items() if c not in needed}


def _load(load: Callable[..., Manifest | None], repo: Repository, man: Manifest, key: str) -> Manifest | None:
    """A kept version's fold or bridge, None when it is absent or unusable (then removed); a store error stops gc:
    a timeout read as "unusable" deleted a kept version's bridge and fold for good."""
    try:
        return load(repo, man, strict=True)
    except StoreError as exc:
        raise StoreError(f"gc stopped: {key} cannot be read ({exc}); run gc again") from None


def _fold_keys(repo: Repository) -> list[tuple[int, str]]:
    return _versioned_keys(repo, FOLD_PREFIX, parse_fold_key)


def _bridge_keys(repo: Repository) -> list[tuple[int, str]]:
    return _versioned_keys(repo, BRIDGE_PREFIX, parse_bridge_key)


def _versioned_keys(repo: Repository, prefix: str, parse: Callable[[str], int | None]) -> list[tuple[int, str]]:
    """(version, key) of every object under `prefix` named as a writer names one (folds/, bridges/)."""
    out = []
    for key in repo.objects.list(prefix):
        v = parse(key)
        if v is not None:
            out.append((v, key))
    return out


def _chain(repo: Repository, version: int) -> list[Manifest]:
    try:
        return plan_chain(repo, version, None).steps
    except DeltafsError as exc:
        # Deleting anything from a store whose chains are already broken could lose more: stop.
        raise IntegrityError(f"gc stopped: version {version} cannot be rebuilt ({exc}); run 'deltafs verify --all'") from None


def _created(man: Manifest) -> float:
    seconds = parse_timestamp(man.created)
    return time.time() if seconds is None else seconds  # unknown: treat as new, which only keeps more


def _plan_removal(repo: Repository, key: str, version: int, into: dict[int, int]) -> None:
    """into[version] = the size of `key`, unless it is gone since the listing (another gc)."""
    try:
        into[version] = repo.objects.size(key)
    except ObjectNotFoundError:
        pass


def stat(objects: ObjectStore, key: str) -> tuple[int, float | None]:
    """(size, last-modified seconds since the epoch or None) of one object."""
    return objects.stat(key)

