"""Reader side: HEAD → manifest → chunks, re-hash everything, then flip DEST atomically.

Disk space: a pull writes the new version beside the current one (files that did not change are
hard-linked, so a delta pull needs about the changed files' size), and by default keeps every fetched
chunk in DEST.deltafs/chunks/ until the version is installed, so a killed pull resumes without
refetching. A cold pull therefore needs the checkpoint's size plus its stored (compressed) size;
chunk_cache=False (`--no-chunk-cache`) needs only the checkpoint's size.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from deltafs.errors import (
    ChunkNotFoundError,
    FormatError,
    IntegrityError,
    ObjectNotFoundError,
    StoreError,
    UsageError,
    VersionNotFoundError,
    check_count,
    is_local_write_failure,
    local_write_error,
)
from deltafs.format.keys import manifest_key
from deltafs.format.manifest import Head
from deltafs.format.versions import check_version
from deltafs.read.dest import LocalCheckpoint, LocalState, check_layout, precheck, refuse_foreign, refuse_nested
from deltafs.progress import Progress, binary_size
from deltafs.read.chain import MAX_BRIDGES, Chain, plan_chain
from deltafs.read.rebuild import Builder, ChunkSource, LocalBaseError
from deltafs.store.repo import Repository

log = logging.getLogger("deltafs")


@dataclass(frozen=True)
class PullResult:
    version: int
    previous: int | None
    updated: bool
    path: str
    bytes_read: int
    seconds: float
    fallback: bool = False  # the delta path failed and the version was rebuilt from a full version
    from_full: bool = False
    repaired: str | None = None  # DEST held this version but a file was edited or missing: what was wrong

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def local_version(dest: str) -> LocalState | None:
    """What a managed DEST holds now, or None."""
    return LocalCheckpoint(dest).state()


def checked_head(repo: Repository) -> Head | None:
    """The store's newest version, after checking that HEAD names a manifest that exists and matches.

    VersionNotFoundError (exit 4) for a HEAD naming a missing version, FormatError (exit 5) for a HEAD
    whose digest is not that manifest's: both say it is HEAD that is wrong, and how to look further.
    """
    head = repo.head()
    if head is None:
        return None
    problem = repo.head_error(head)
    if problem is not None:
        raise problem
    return head


def resolve_version(repo: Repository, version: int | None) -> int:
    if version is not None:
        return version
    head = checked_head(repo)
    if head is None:
        raise VersionNotFoundError(f"{repo.url} has no versions yet")
    return head.version


def pull(store: str | Repository, dest: str, *, version: int | None = None,
         storage_options: dict[str, Any] | None = None, force: bool = False, progress: bool = False,
         wait_lock: bool = True, threads: int | None = None, keep: int = 2, verify_files: bool = False,
         chunk_cache: bool = True, recycle: bool = True) -> PullResult:
    """Make DEST a complete, verified checkpoint of `version` (default: newest).

    DEST is a symlink into DEST.deltafs/; at every instant it points to one complete version. A DEST
    that already holds the version is checked (sizes and install mtimes; every digest with
    verify_files) and repaired if a file was edited or removed.

    recycle: write the new version into the files of the version this pull's cleanup would remove (the oldest
    beyond the `keep` newest; never the current one), instead of new files; off, that version is deleted
    after the install as before. Either way it is gone after a successful pull; with recycle it is also
    gone after a failed one, and a process still reading it sees its bytes change.
    """
    t0 = time.monotonic()
    _check_arguments(dest, version, threads, keep, storage_options)
    version = None if version is None else check_version(version)  # an int from here (numpy's integers too)
    repo = store if isinstance(store, Repository) else Repository.open(store, storage_options)
    local = LocalCheckpoint(dest)
    refuse_nested(local, repo.objects.local_root)
    precheck(local, force)  # before the lock creates anything beside DEST
    with local.lock(wait=wait_lock):
        state = refuse_foreign(local, repo.store_id, force)
        previous = local.linked_name()  # kept by the cleanup below whatever the mtimes say: engines may read it
        local.remove_stale_staging()  # a killed pull's: it may hold the space of the version it was recycling
        target = resolve_version(repo, version)
        repaired = None
        if state is not None and state.version == target:
            man = repo.manifest(target)
            if man.digest == state.digest:
                repaired = local.check_files(state, full=verify_files)
                if repaired is None:
                    return PullResult(target, state.version, False, state.path, 0, time.monotonic() - t0)
                log.warning(f"{local.dest}: {repaired}; repairing version {target}")
            else:
                state = None  # same number, other contents (store rewritten): rebuild
        chain = None
        recycle_keep = keep if recycle else 0
        try:
            chain = _plan(repo, target, state, repaired is not None)
            path, source, _ = _materialize(repo, local, chain, progress, threads, chunk_cache, recycle_keep)
            fallback = False
        except (LocalBaseError, IntegrityError, ObjectNotFoundError, FormatError) as exc:
            if isinstance(exc, FormatError) and (chain is None or not _accelerated(chain)):
                raise  # in the version's own records: final (a bridge's or fold's is only an accelerator's)
            if state is None and (chain is None or chain.final is None):
                raise _failure_of(repo, exc, target) from None  # already the plain path from a full version
            # The delta path is unusable (local base corrupt, chunk missing or bad): start over
            # from the nearest full version. A full-path failure is final.
            log.warning(f"delta path to version {target} failed ({exc}); rebuilding from a full version")
            try:
                chain = _linking(plan_chain(repo, target, None), state)  # linked files are re-hashed first
                path, source, _ = _materialize(repo, local, chain, progress, threads, chunk_cache, recycle_keep)
            except (IntegrityError, ObjectNotFoundError, VersionNotFoundError) as exc2:
                raise _failure_of(repo, exc2, target) from None
            fallback = True
        local.drop_chunk_cache()
        local.cleanup(keep=keep, also_keep=previous)
        log.info("pulled version %d into %s from %s (%s read)", target, dest,
                 "a full version" if chain.local is None else f"version {chain.local.version}",
                 binary_size(source.bytes_read))
        return PullResult(
            version=target,
            previous=state.version if state else None,
            updated=True,
            path=path,
            bytes_read=source.bytes_read,
            seconds=time.monotonic() - t0,
            fallback=fallback,
            from_full=chain.local is None,
            repaired=repaired,
        )


def _check_arguments(dest: Any, version: Any, threads: Any, keep: Any, storage_options: Any) -> None:
    """UsageError (exit 2) for arguments of the wrong type or range, before anything is read or written."""
    if not isinstance(dest, (str, os.PathLike)):
        raise UsageError(f"dest must be a path, got {type(dest).__name__}")
    if version is not None:
        check_version(version)
    if threads is not None:
        check_count(threads, "threads", 1)
    check_count(keep, "keep", 0)
    if storage_options is not None and not isinstance(storage_options, dict):
        raise UsageError(f"storage_options must be a dict, got {type(storage_options).__name__}")


def _plan(repo: Repository, target: int, state: LocalState | None, repair: bool) -> Chain:
    if not repair:
        return _linking(plan_chain(repo, target, state, folds=True, bridges=MAX_BRIDGES), state)
    # Repair of the version DEST already holds: rebuild from the nearest full version, but let the
    # builder hard-link every local file whose sha256 still matches, so only edited files are fetched.
    return replace(plan_chain(repo, target, None, folds=True), local=state)


def _linking(chain: Chain, state: LocalState | None) -> Chain:
    """chain, taking DEST's unchanged files by hard link when it starts from a full version instead of DEST."""
    return replace(chain, link=state) if chain.local is None and state is not None else chain


def _accelerated(chain: Chain) -> bool:
    """Whether the chain reads a fold or a bridge: records that are not the version's own, and that a reader may
    always do without (FORMAT.md), so anything wrong with them sends the pull to the plain path."""
    return chain.final is not None or any("bridge_of" in step.stats for step in chain.steps)


def _failure_of(repo: Repository, exc: BaseException, version: int) -> BaseException:
    """What a pull of version that failed with exc reports: a version removed while it was read (a gc with a short
    --grace) is "not in the store" (exit 4) whichever chunk or parent the pull missed first; anything else is exc,
    named after the version."""
    try:
        gone = not repo.objects.exists(manifest_key(version))
    except StoreError:
        gone = False
    if gone:
        return VersionNotFoundError(f"version {version} is not in {repo.url}: it was removed while this pull read it "
                                    "(a gc with a short --grace?)")
    return _name_version(exc, version)


def _name_version(exc: BaseException, version: int) -> BaseException:
    """The same failure, its message starting with the version (a missing chunk is exit 6, not 3)."""
    if f"version {version}" in str(exc):
        return exc
    if isinstance(exc, ChunkNotFoundError) or (isinstance(exc, ObjectNotFoundError) and "chunks/" in str(exc)):
        return ChunkNotFoundError(f"version {version}: {exc}")
    if isinstance(exc, IntegrityError):
        return IntegrityError(f"version {version}: {exc}")
    return exc


def _materialize(repo: Repository, local: LocalCheckpoint, chain: Chain, progress: bool,
                 threads: int | None, chunk_cache: bool, recycle_keep: int) -> tuple[str, ChunkSource, Any]:
    """Build the chain's target into a staging directory and install it; recycle_keep > 0: the staging
    directory may be the version that cleanup(recycle_keep) removes after the install."""
    check_layout(chain.target)  # a version that cannot be laid out fails before anything is written
    # One build per source: only objects several chunk records name are worth the memo (rebuild._shared_objects).
    source = ChunkSource(repo, local.open_chunk_cache() if chunk_cache else None, memo_unshared=False)
    staging = None
    if recycle_keep > 0:
        staging = local.recycle_as_staging(recycle_keep, {f.path for f in chain.target.files})
    if staging is None:
        staging = local.new_staging()
    total = chain.target.raw_bytes
    try:
        with Progress(f"pull v{chain.target.version}", total, enabled=progress) as bar:
            Builder(repo, chain, source, threads=threads, on_bytes=bar.advance).build(staging)
        if local.describe_foreign() is not None:
            local.displace()  # only reached with force: refuse_foreign() raised otherwise
        path = local.install(staging, store_id=repo.store_id, store_url=repo.url, manifest=chain.target)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, OSError) and is_local_write_failure(exc):
            # Fetched chunks are kept for the retry unless the disk is full: then they are the space.
            if not chunk_cache or exc.errno in (errno.ENOSPC, errno.EDQUOT):
                local.drop_chunk_cache()
            raise local_write_error(exc, exc.filename or f"version {chain.target.version} into {staging}",
                                    hint=_space_hint(chain, chunk_cache and repo.objects.local_root is None)) from None
        raise
    return path, source, None


def _space_hint(chain: Chain, chunk_cache: bool) -> str:
    """chunk_cache: fetched chunks are kept beside DEST (a remote store's pull)."""
    need = chain.target.raw_bytes
    amount = f"{need / 2**30:.2f} GiB" if need >= 2**30 else f"{max(need / 2**20, 0.1):.1f} MiB"
    return (f" (a pull of version {chain.target.version} needs about {amount} free beside DEST"
            f"{', plus the fetched chunks; --no-chunk-cache avoids those' if chunk_cache else ''})")


__all__ = ["PullResult", "pull", "local_version", "resolve_version", "checked_head"]
