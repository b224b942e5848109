"""The one push pipeline, for a world of 1..N ranks: plan, encode, commit, fold (and a keyframe's bridge).

Every step that must agree across ranks is a collective over a `World` (a single process is a
world of one; deltafs.publish.distributed supplies one over torch.distributed):
1. every rank reports the size of its files; the root reads HEAD, picks the version number and its
   kind (plan.decide) and broadcasts the decision;
2. every rank encodes its own files against its base (its push cache, re-derived from the store
   when missing or stale) and writes their chunks, under an in-flight marker that gc honours; a full
   version with a parent is also encoded against the parent while the push cache still holds it, for
   its bridge (deltafs.publish.bridge);
3. only if every rank succeeded does the root write the bridge (if every rank made its part), then
   the manifest (the commit point) and HEAD; a gc that removed chunks meanwhile makes every rank
   encode again;
4. every rank installs its new push cache; with fold=True the ranks encode their files against
   the last full version and the root writes the fold.
A rank that fails or dies before step 3 leaves chunks no manifest references (gc removes them) and
no visible version.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from deltafs.errors import DeltafsError, UsageError, is_local_write_failure, local_write_error
from deltafs.format.manifest import FileEntry, Manifest, path_clash
from deltafs.parallel import default_threads
from deltafs.progress import Progress
from deltafs.publish.bridge import encode_bridge_part, write_bridge
from deltafs.publish.commit import ChunksGoneError, commit_version, seal_manifest
from deltafs.publish.encode import EncodeStats, Encoder, discard, patchable
from deltafs.publish.fold import FoldPart, encode_fold_part, fold_needed, write_fold
from deltafs.publish.options import PushOptions, PushResult
from deltafs.publish.plan import Decision, base_for, cached_base, decide, default_cache_dir, drop_cache
from deltafs.publish.source import SourceFile, scan_file
from deltafs.read.dest import SIDECAR_SUFFIX, LocalCheckpoint, LocalState, sidecar_holding
from deltafs.store.open import local_path
from deltafs.read.rebuild import LocalBaseError
from deltafs.store.lock import PushGuard
from deltafs.store.repo import Repository

T = TypeVar("T")
log = logging.getLogger("deltafs")
ENCODE_ATTEMPTS = 3  # a gc that removed chunks under a push makes it encode again, this often at most
NO_LINK_FLAG = "no-link"  # in the cache root: this trainer rewrites files in place; copy, never hard-link


class DistributedPushError(DeltafsError, RuntimeError):
    """Another rank failed, so this version was not committed (or, if the group broke while the root committed,
    the message says the outcome is not known here)."""


class World(Protocol):
    """The collectives the pipeline needs."""

    rank: int
    world: int

    @property
    def is_root(self) -> bool: ...

    def all_gather(self, obj: Any) -> list[Any]: ...

    def broadcast(self, obj: Any) -> Any: ...


class Solo:
    """A world of one: a single-process push."""

    rank, world = 0, 1
    is_root = True

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast(self, obj: Any) -> Any:
        return obj


@dataclass
class _Failure:
    """A rank's exception, as sent to the other ranks."""

    rank: int
    kind: str
    message: str


def _raise_first(results: list[Any], own: BaseException | None, what: str) -> None:
    """If any rank failed: re-raise this rank's own error, or a DistributedPushError naming the first failure."""
    failures = [r for r in results if isinstance(r, _Failure)]
    if not failures:
        return
    if own is not None:
        raise own
    f = failures[0]
    raise DistributedPushError(f"{what}: rank {f.rank} failed ({f.kind}: {f.message}); version not committed")


def collective(world: World, what: str, fn: Callable[[], T], *, tag: str | None = None) -> list[T]:
    """Run fn on every rank and all-gather the results; any failure raises on every rank. tag (default what): the
    pipeline step the ranks must all be at (see _check_in_step)."""
    own: BaseException | None = None
    value: Any
    try:
        value = fn()
    except Exception as exc:  # sent to the other ranks, then re-raised
        own, value = exc, _Failure(world.rank, type(exc).__name__, str(exc))
    if world.world == 1 and own is not None:
        raise own
    step = what if tag is None else tag
    tagged = world.all_gather((step, value))
    _check_in_step([(f"rank {r}", _step_of(t)) for r, t in enumerate(tagged)], step, world.rank)
    results = [t[1] for t in tagged]
    _raise_first(results, own, what)
    return results


def _step_of(tagged: Any) -> Any:
    return tagged[0] if isinstance(tagged, tuple) and len(tagged) == 2 else None


def _check_in_step(steps: list[tuple[str, Any]], what: str, rank: int) -> None:
    """Every rank's collective is the same step of the pipeline, or DistributedPushError on every rank that sees it.
    Ranks that fell out of step (one skipped a collective) met each other's next collective and took its payload
    for their own: a version mixed two training steps (adversarial pass, fold= on the root only)."""
    for who, step in steps:
        if step != what:
            raise DistributedPushError(f"the ranks are out of step: {who} is {step!r}, rank {rank} (this one) "
                                       f"{what!r}; version not committed")


def from_root(world: World, what: str, fn: Callable[[], T]) -> T:
    """Run fn on the root and broadcast its result; a failure there raises on every rank."""
    own: BaseException | None = None
    value: Any = None
    if world.is_root:
        try:
            value = fn()
        except Exception as exc:
            if world.world == 1:
                raise
            own, value = exc, _Failure(world.rank, type(exc).__name__, str(exc))
    try:
        tagged = world.broadcast((what, value))
        _check_in_step([("the root", _step_of(tagged))], what, world.rank)
        value = tagged[1]
    except DistributedPushError as exc:
        if what != "committing":
            raise
        # The root may have committed before the group broke: "not committed" would invite a second push of the
        # same step. The root knows; the others can only point at the store.
        cause = str(exc).removesuffix("; version not committed")
        if world.is_root and own is None:
            raise DistributedPushError(f"{cause}; this rank (the root) committed the version, but the other ranks "
                                       "could not be told") from exc
        raise DistributedPushError(f"{cause} while the root was committing: the version may have been committed "
                                   "(`deltafs log` on the store says; do not push the step again before looking)"
                                   ) from exc
    _raise_first([value], own, what)
    return value  # type: ignore[no-any-return]


@dataclass
class RankReport:
    """What a rank sends the root after encoding."""

    files: list[FileEntry]  # objects, not JSON: built by our own code on every rank (pickled across ranks)
    stats: EncodeStats
    rederived: bool
    lapsed: bool  # its in-flight marker may have expired: the root checks every chunk
    bridge: tuple[list[FileEntry], EncodeStats] | None = None  # this rank's part of a full version's bridge
    marker: str | None = None  # the key of its in-flight marker in the store it wrote to (None: it wrote nothing)


@dataclass
class Outcome:
    """The root's commit outcome, broadcast to every rank."""

    manifest: bytes | None  # None: chunks were gone, encode again
    manifest_size: int = 0
    result: dict[str, Any] = field(default_factory=dict)


@dataclass
class RankWork:
    """One rank's part of a push: its files and where its caches live."""

    files: list[SourceFile]
    cache_root: str | None = None  # default: opts.cache_dir or ~/.cache/deltafs/push/<store id>
    cache_name: str = ""  # "rank-3" in a multi-rank push: each rank has its own caches
    inherit_files: bool = False  # also keep the parent's non-tensor files this push does not name
    extra_stats: dict[str, Any] = field(default_factory=dict)


def run(world: World, store: str | Repository, work: RankWork, opts: PushOptions, *,
        t0: float | None = None) -> PushResult:
    """Push this rank's files as part of one version; every rank of `world` must call it. See the module docstring."""
    t0 = time.monotonic() if t0 is None else t0

    def size() -> int:
        _refuse_store_in_a_dest(store)  # on every rank: each may name another path to the same store
        return sum(f.size for f in work.files)

    sizes = collective(world, "sizing the checkpoint", size)
    repo_box: list[Repository] = []

    def open_repo(create: bool = False) -> Repository:
        if not repo_box:
            repo_box.append(store if isinstance(store, Repository) else
                            Repository.open(store, dict(opts.storage_options or {}) or None, create=create))
        return repo_box[0]

    decision: Decision = from_root(world, "reading the store", lambda: decide(open_repo(create=True), opts, sum(sizes)))
    with contextlib.ExitStack() as stack:
        rank = _Rank(world, open_repo, decision, work, opts, stack)
        collective(world, "opening the push cache", rank.open)
        progress = opts.progress and world.world == 1
        for attempt in range(ENCODE_ATTEMPTS):
            reports = collective(world, "writing chunks", lambda: rank.encode(progress=progress))
            last = attempt == ENCODE_ATTEMPTS - 1
            outcome = from_root(world, "committing", functools.partial(rank.commit, reports, last=last, t0=t0))
            if outcome.manifest is not None:
                break
            rank.discard()
        assert outcome.manifest is not None
        man = Manifest.from_bytes(outcome.manifest, where=f"manifest of version {decision.version}")
        rank.install_committed(man)
        # The marker stays until the fold is written: the fold's chunks are as young as this push and only the
        # marker keeps a gc from removing them before the fold names them. Not "committing" meanwhile (the
        # version is committed; a gc need not wait for the fold's encode): write_fold marks it again.
        rank.after_commit()
        fold_bytes = rank.fold(man) if decision.fold else 0
        rank.close_guard()
    return PushResult(**{**outcome.result, "seconds": time.monotonic() - t0, "fold_bytes": fold_bytes,
                         "digest": man.digest,
                         "base_rederived": any(r.rederived for r in reports)})


def _refuse_store_in_a_dest(store: str | Repository) -> None:
    """A local store path that is a pulled DEST, or lies in one's sidecar, is refused (exit 2) before the store is
    created: the push wrote the store into the version directory an engine served, and the next pull's repair
    deleted it as files foreign to that version."""
    path = local_path(store) if isinstance(store, str) else store.objects.local_root
    if path is None:
        return
    sidecar = sidecar_holding(path)
    if sidecar is not None:
        name = store if isinstance(store, str) else store.url
        raise UsageError(f"the store {name} is inside {sidecar}, where deltafs keeps the versions pulled into "
                         f"{sidecar[:-len(SIDECAR_SUFFIX)]}; push to a store directory outside it")


def _from_copy(files: list[SourceFile], root: str) -> list[SourceFile]:
    """files, with the in-memory ones (push_tensors) read from their copy under `root` (a push cache that holds this
    version) instead of from the tensors: an accelerator's tensors would otherwise cross to the host a second time."""
    return [f if f.pieces is None else replace(f, abspath=os.path.join(root, f.path), pieces=None) for f in files]


def _inside(path: str, root: str) -> bool:
    return os.path.abspath(path).startswith(os.path.join(os.path.abspath(root), ""))


def _moved(f: SourceFile, old: str, new: str) -> SourceFile:
    """f, read from directory `new` if it was read from `old` (an inherited file of a patched push cache)."""
    inside = os.path.join(old, "")
    if f.pieces is None and f.abspath.startswith(inside):
        return replace(f, abspath=os.path.join(new, f.abspath[len(inside):]))
    return f


class _Rank:
    """This rank's state through one push: cache, base, encoder, marker."""

    def __init__(self, world: World, open_repo: Callable[[], Repository], decision: Decision, work: RankWork,
                 opts: PushOptions, stack: contextlib.ExitStack) -> None:
        self.world, self.open_repo, self.decision, self.work, self.opts, self.stack = \
            world, open_repo, decision, work, opts, stack
        self.threads = opts.threads or default_threads()
        self.files = list(work.files)
        self.stage: str | None = None
        self.base: LocalState | None = None
        self.bridge_base: LocalState | None = None  # a full version's parent, as the push cache holds it
        self.rederive = False
        self.guard: PushGuard | None = None
        self.encoded: list[SourceFile] = []  # the files of the last encode, inherited ones included

    # --- caches ----------------------------------------------------------------------------
    def open(self) -> None:
        with self._cache_writes():
            self._open()

    def _open(self) -> None:
        repo = self.open_repo()
        if repo.store_id != self.decision.store_id:
            raise DeltafsError(f"rank {self.world.rank} sees another store at {repo.url} than the root rank")
        root = self.work.cache_root or self.opts.cache_dir or default_cache_dir(repo.store_id)
        self.cache_root = os.path.join(root, self.work.cache_name) if self.work.cache_name else root
        self.cache = LocalCheckpoint(os.path.join(self.cache_root, "base"))
        self.keyframe = LocalCheckpoint(os.path.join(self.cache_root, "keyframe"))
        self.stack.enter_context(self.cache.lock(wait=False, name="push.lock"))
        self.stack.callback(self.discard)
        if self.files:
            self.guard = PushGuard(repo.objects).__enter__()
            self.stack.callback(self.close_guard)

    def after_commit(self) -> None:
        if self.guard is not None:
            try:
                self.guard.committing(False)
            except Exception as exc:  # noqa: BLE001 - committed already; a gc then waits for the marker to lapse
                log.warning("cannot update this push's marker in the store after the commit: %s", exc)

    def close_guard(self) -> None:
        if self.guard is not None:
            self.guard.__exit__(None, None, None)
            self.guard = None

    def _parent(self) -> Manifest | None:
        head = self.decision.head
        return self.open_repo().manifest(head.version) if head is not None else None

    def _inherited(self, parent: Manifest) -> list[str]:
        """The parent's plain files (tokenizer, generation_config.json ...) that this push does not name."""
        from deltafs.publish.hf import INDEX_FILE

        named = {f.path for f in self.files}
        kept = []
        for f in parent.files:
            if f.format != "blob" or f.path == INDEX_FILE or f.path in named:
                continue
            clash = path_clash(named | {f.path})
            if clash is not None:  # this push made a file of its directory, or a directory of it: its own files win
                log.info("not keeping %s of version %s: %s is now both a file and a directory", f.path,
                         parent.version, clash[0])
                continue
            kept.append(f.path)
        return kept

    def _prepare_base(self) -> tuple[list[SourceFile], bool]:
        """The files to encode (with inherited ones) and the base; rebuilt from the store when needed."""
        files = list(self.files)
        parent = self._parent()
        inherit = self._inherited(parent) if parent is not None and self.work.inherit_files else []
        keys = {seg.key for f in files for seg in f.segments} | {f"f:{p}" for p in inherit}
        self.base, self.bridge_base, rederived = None, None, False
        if parent is not None and (self.decision.kind == "delta" or inherit):
            self.base, rederived = base_for(self.open_repo(), self.cache, parent, keys, rederive=self.rederive)
            if not rederived and self._rewritten_in_place(files, self.base):
                # The trainer rewrote a file the cache had hard-linked: the base is gone. Copy from now on.
                open(os.path.join(self.cache_root, NO_LINK_FLAG), "a").close()
                self.base, rederived = base_for(self.open_repo(), self.cache, parent, keys, rederive=True)
        if inherit:
            assert self.base is not None
            files += [scan_file(p, os.path.join(self.base.path, p)) for p in inherit]
        if parent is not None and self.decision.bridge:
            # Only a cache that holds the parent already: re-deriving it would read the whole parent for a bridge.
            self.bridge_base = self.base or cached_base(self.open_repo(), self.cache, parent, keys)
            if self.bridge_base is not None and self.base is None and self._rewritten_in_place(files, self.bridge_base):
                self.bridge_base = None  # the trainer rewrote a file the cache had hard-linked: the parent is gone
        return files, rederived

    @staticmethod
    def _linked(files: list[SourceFile], base: LocalState) -> Iterator[os.stat_result]:
        """The stat of each source file that is the base's file of the same path (one inode: the cache hard-linked
        it)."""
        for f in files:
            if f.pieces is not None:
                continue
            try:
                src, old = os.stat(f.abspath), os.stat(os.path.join(base.path, f.path))
            except OSError:
                continue
            if (src.st_dev, src.st_ino) == (old.st_dev, old.st_ino):
                yield src

    @classmethod
    def _shares_files(cls, files: list[SourceFile], base: LocalState) -> bool:
        return any(True for _ in cls._linked(files, base))

    @classmethod
    def _rewritten_in_place(cls, files: list[SourceFile], base: LocalState) -> bool:
        try:
            installed = os.stat(base.path + ".json").st_mtime_ns
        except OSError:
            return False
        return any(src.st_mtime_ns > installed for src in cls._linked(files, base))

    @contextlib.contextmanager
    def _cache_writes(self) -> Iterator[None]:
        """A full disk, a read-only or clashing path while this rank writes its push cache: exit 12 naming the
        cache (an OSError from write() names no file). The store's own write failures are store errors already."""
        try:
            yield
        except OSError as exc:
            root = getattr(self, "cache_root", None)  # set by open(), which may be what failed
            named = os.fsdecode(exc.filename) if isinstance(exc.filename, (str, bytes, os.PathLike)) else None
            if not is_local_write_failure(exc) or (named is not None and (root is None or not _inside(named, root))):
                raise  # not a write of the cache (a source file turned into a directory, say): as it is
            raise local_write_error(exc, named or root or "the push cache", " (the push cache: free space there, or "
                                    "choose another with --cache or DELTAFS_CACHE)",
                                    elsewhere="or choose another push cache with --cache or DELTAFS_CACHE") from None

    # --- encode ----------------------------------------------------------------------------
    def encode(self, *, progress: bool) -> RankReport:
        with self._cache_writes():
            return self._encode(progress=progress)

    def _encode(self, *, progress: bool) -> RankReport:
        if not self.files:
            return RankReport([], EncodeStats(), False, False, ([], EncodeStats()) if self.decision.bridge else None)
        rederived = False
        for attempt in range(2):
            files, fresh = self._prepare_base()
            rederived = rederived or fresh
            allow_link = self.opts.link == "auto" and not os.path.exists(os.path.join(self.cache_root, NO_LINK_FLAG))
            base = self.base if self.decision.kind == "delta" else None
            patch = base is not None and self._patch_cache(files, base, allow_link)
            if patch:
                assert base is not None
                # The cache's own directory becomes the stage: from here until install there is no cached
                # version (a push killed meanwhile makes the next one rebuild its base from the store).
                old = base.path
                base = self.base = replace(base, path=self.cache.adopt_as_staging(base))
                self.stage = base.path
                files = [_moved(f, old, self.stage) for f in files]  # inherited files are read where they now are
            else:
                self.stage = self.cache.new_staging()
            enc = Encoder(self.open_repo(), base, level=self.opts.level, full_level=self.opts.full_level,
                          threads=self.threads, stage_dir=self.stage,
                          allow_link=allow_link, patch=patch,
                          versions=((base.store_id, base.version, base.digest) if base is not None else None,
                                    (self.decision.store_id, self.decision.version)))
            try:
                with Progress(f"push v{self.decision.version}", sum(f.size for f in files), enabled=progress) as bar:
                    entries = enc.encode(files, bar.advance)
            except LocalBaseError:
                if base is not None and self._shares_files(files, base):
                    # A base file the cache had hard-linked changed under the same inode with its old mtime (cp -p,
                    # rsync --inplace -t): _rewritten_in_place cannot see that, so say it here. Copy from now on.
                    with contextlib.suppress(OSError):  # best effort: the error to report is the base's
                        open(os.path.join(self.cache_root, NO_LINK_FLAG), "a").close()
                self.discard()
                if attempt or self.rederive:
                    raise  # the cache was just rebuilt from the store: something else is wrong
                drop_cache(self.cache)
                self.rederive = True
                continue
            self.rederive = False
            self.encoded = files
            bridge = self._encode_bridge(files) if self.decision.bridge else None
            assert self.guard is not None
            self.guard.refresh()  # protected again from here, whatever happened while encoding
            return RankReport(entries, enc.stats, rederived, self.guard.lapsed, bridge, self.guard.key)
        raise AssertionError("unreachable")

    def _encode_bridge(self, files: list[SourceFile]) -> tuple[list[FileEntry], EncodeStats] | None:
        """This rank's files of a full version against its parent (the push cache, not yet replaced)."""
        if self.bridge_base is None:
            log.info("no bridge for version %s: the push cache does not hold its parent", self.decision.version)
            return None
        assert self.stage is not None  # the new cache's copy, which the full encode just wrote
        return encode_bridge_part(self.open_repo(), self.bridge_base, _from_copy(files, self.stage),
                                  level=self.opts.level, full_level=self.opts.full_level, threads=self.threads)

    def _patch_cache(self, files: list[SourceFile], base: LocalState, allow_link: bool) -> bool:
        """Whether to update the cache by writing the changed chunks into its files (see encode.patchable).

        Only where a link or reflink cannot give the cache the new files for free: in-memory files, files
        the cache may not link (the trainer rewrites them), or files on another filesystem than the cache.
        """
        if not patchable(files, base):
            return False
        if not allow_link or any(f.pieces is not None for f in files):
            return True
        try:
            cache_dev = os.stat(base.path).st_dev
            return any(os.stat(f.abspath).st_dev != cache_dev for f in files)
        except OSError:
            return False

    def discard(self) -> None:
        discard(self.stage)
        self.stage = None

    # --- commit (root) -----------------------------------------------------------------------
    def commit(self, reports: list[RankReport], *, last: bool, t0: float) -> Outcome:
        repo = self.open_repo()
        # The assembled manifest is checked whole below (Manifest.checked): no JSON round trip per file here.
        entries = sorted((f for r in reports for f in r.files), key=lambda f: f.path)
        if not entries:
            raise DeltafsError("no rank had a file to push")
        stats = EncodeStats()
        for r in reports:
            stats.add(r.stats)
        parent = self._parent()
        kind = self.decision.kind
        extra = dict(self.work.extra_stats)
        if self.world.world > 1:
            extra["ranks"] = self.world.world
        # Sealed and checked: never commit a manifest that a reader would refuse; the bytes broadcast below are
        # then known.
        man = seal_manifest(repo, version=self.decision.version, kind=kind, parent=parent, files=entries,
                            metadata=self.opts.metadata, stats=stats, extra_stats=extra)
        lapsed = any(r.lapsed for r in reports)
        if self.guard is not None:
            self.guard.refresh()
            lapsed = lapsed or self.guard.lapsed
        self._check_same_store(repo, reports)
        bridge_bytes = self._write_bridge(man, reports, lapsed) if self.decision.bridge else 0
        try:
            size = commit_version(repo, man, head_seen=self.decision.head, stats=stats, lapsed=lapsed, guard=self.guard)
        except ChunksGoneError:
            if last:
                raise
            return Outcome(None)
        changed = stats.elements_changed / stats.elements_total if stats.elements_total else 0.0
        result = {
            "version": man.version,
            "kind": kind,
            "parent": man.parent,
            "bytes_written": stats.stored + size,
            "full_bytes": man.raw_bytes,
            "chunks_written": stats.chunks_written,
            "changed_fraction": changed if kind == "delta" else 1.0,
            "seconds": time.monotonic() - t0,
            "store": repo.url,
            "metadata": dict(self.opts.metadata),
            "bridge_bytes": bridge_bytes,
        }
        return Outcome(man.to_bytes(), size, result)

    def _check_same_store(self, repo: Repository, reports: list[RankReport]) -> None:
        """Every rank wrote its chunks where the root commits: its in-flight marker is in the root's store. A rank
        given a copy of the store (the same store id at another path, a synced replica) passes the store-id check
        at open; its chunks would be missing from the committed version. A rank whose marker may have lapsed is
        covered by the root's check of every chunk instead (commit_version)."""
        for rank, r in enumerate(reports):
            if r.marker is None or r.lapsed or rank == self.world.rank:
                continue
            if not repo.objects.exists(r.marker):
                raise UsageError(f"rank {rank} did not write to the store the root commits to ({repo.url}): its "
                                 "in-flight marker is not there (a copy of the store at another path or URL?); "
                                 "nothing was committed")

    def _write_bridge(self, man: Manifest, reports: list[RankReport], lapsed: bool) -> int:
        """The bridge of full version `man` from every rank's part, before `man` is committed; 0 if none."""
        parts = [r.bridge for r in reports if r.bridge is not None]
        if len(parts) < len(reports):
            return 0  # a rank could not encode its part (logged there)
        stats = EncodeStats()
        for _files, part_stats in parts:
            stats.add(part_stats)
        try:
            return write_bridge(self.open_repo(), man, [f for files, _stats in parts for f in files], stats,
                                lapsed=lapsed, guard=self.guard)
        except (DeltafsError, OSError) as exc:
            log.warning("version %s goes without its bridge: %s", man.version, exc)
            return 0

    def install_committed(self, man: Manifest) -> None:
        """install(), after the commit: the version is published whatever happens here, so a push cache that
        cannot take it (a full disk) is a warning, and the next push rebuilds its base from the store."""
        try:
            self.install(man)
        except (DeltafsError, OSError) as exc:
            log.warning("version %s is committed, but the push cache at %s could not take it (%s); the next push "
                        "rebuilds its base from the store", man.version, self.cache_root,
                        exc.strerror if isinstance(exc, OSError) and exc.strerror else exc)
            with contextlib.suppress(OSError):
                self.discard()

    def install(self, man: Manifest) -> None:
        if self.stage is None:
            return
        final = self.cache.install(self.stage, store_id=man.store_id, store_url=self.open_repo().url, manifest=man)
        self.encoded = [_moved(f, self.stage, final) for f in self.encoded]  # a patched stage is the version now
        self.stage = None
        self.cache.cleanup(keep=1, background=True)  # the push is done once installed: freeing the old files is not its work

    # --- fold ------------------------------------------------------------------------------
    def fold(self, man: Manifest) -> int:
        """Write the fold of the version just committed (see deltafs.publish.fold); 0 if none was written."""
        def part() -> FoldPart | None:
            if not self.encoded:
                return FoldPart([], EncodeStats()) if fold_needed(man) else None
            state = self.cache.state()
            if state is None or state.digest != man.digest:
                raise DeltafsError("the push cache does not hold the version just committed")
            done = encode_fold_part(self.open_repo(), man, state, self.keyframe, _from_copy(self.encoded, state.path),
                                    level=self.opts.level, full_level=self.opts.full_level, threads=self.threads)
            if done is not None and self.guard is not None:
                self.guard.refresh()  # protected again from here, whatever happened while encoding (as encode does)
                done = replace(done, lapsed=self.guard.lapsed)
            return done

        try:
            parts = collective(self.world, "folding", part)
            real = [p for p in parts if p is not None]
            if len(real) != len(parts):
                return 0  # a full version (the keyframe caches were updated), or nothing to fold
            return from_root(self.world, "writing the fold", lambda: write_fold(self.open_repo(), man, real, self.guard))
        except (DeltafsError, OSError) as exc:
            log.warning("version %s is committed, but its fold was not written: %s", man.version, exc)
            return 0


__all__ = ["DistributedPushError", "RankReport", "RankWork", "Solo", "World", "collective", "from_root", "run"]
