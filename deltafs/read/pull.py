"""Reader side: HEAD → manifest → chunks, re-hash everything, then flip DEST atomically."""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import asdict, dataclass
from typing import Any

from deltafs.errors import IntegrityError, ObjectNotFoundError, VersionNotFoundError
from deltafs.read.dest import LocalCheckpoint, LocalState, refuse_foreign
from deltafs.progress import Progress
from deltafs.read.chain import Chain, plan_chain
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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def local_version(dest: str) -> LocalState | None:
    """What a managed DEST holds now, or None."""
    return LocalCheckpoint(dest).state()


def resolve_version(repo: Repository, version: int | None) -> int:
    if version is not None:
        return version
    head = repo.head()
    if head is None:
        raise VersionNotFoundError(f"{repo.url} has no versions yet")
    return head.version


def pull(store: str | Repository, dest: str, *, version: int | None = None,
         storage_options: dict[str, Any] | None = None, force: bool = False, progress: bool = False,
         wait_lock: bool = True, threads: int | None = None, keep: int = 2) -> PullResult:
    """Make DEST a complete, verified checkpoint of `version` (default: newest).

    DEST is a symlink into DEST.deltafs/; at every instant it points to one complete version.
    """
    t0 = time.monotonic()
    repo = store if isinstance(store, Repository) else Repository.open(store, storage_options)
    local = LocalCheckpoint(dest)
    with local.lock(wait=wait_lock):
        state = refuse_foreign(local, repo.store_id, force)
        target = resolve_version(repo, version)
        if state is not None and state.version == target:
            man = repo.manifest(target)
            if man.digest == state.digest:
                return PullResult(target, state.version, False, state.path, 0, time.monotonic() - t0)
            state = None  # same number, other contents (store rewritten): rebuild
        chain = None
        try:
            chain = plan_chain(repo, target, state, folds=True)
            path, source = _materialize(repo, local, chain, progress, threads)
            fallback = False
        except (LocalBaseError, IntegrityError, ObjectNotFoundError) as exc:
            if state is None and (chain is None or chain.final is None):
                raise  # already the plain path from a full version (a fold path gets a second chance)
            # The delta path is unusable (local base corrupt, chunk missing or bad): start over
            # from the nearest full version. A full-path failure is final.
            log.warning(f"delta path to version {target} failed ({exc}); rebuilding from a full version")
            chain = plan_chain(repo, target, None)
            path, source = _materialize(repo, local, chain, progress, threads)
            fallback = True
        shutil.rmtree(local.chunk_cache, ignore_errors=True)
        local.cleanup(keep=keep)
        log.info("pulled version %d into %s from %s (%d bytes read)", target, dest,
                 "a full version" if chain.local is None else f"version {chain.local.version}", source.bytes_read)
        return PullResult(
            version=target,
            previous=state.version if state else None,
            updated=True,
            path=path,
            bytes_read=source.bytes_read,
            seconds=time.monotonic() - t0,
            fallback=fallback,
            from_full=chain.local is None,
        )


def _materialize(repo: Repository, local: LocalCheckpoint, chain: Chain, progress: bool,
                 threads: int | None) -> tuple[str, ChunkSource]:
    source = ChunkSource(repo, local.chunk_cache)
    staging = local.new_staging()
    total = chain.target.raw_bytes
    try:
        with Progress(f"pull v{chain.target.version}", total, enabled=progress) as bar:
            Builder(repo, chain, source, threads=threads, on_bytes=bar.advance).build(staging)
        if local.describe_foreign() is not None:
            local.displace()  # only reached with force: refuse_foreign() raised otherwise
        path = local.install(staging, store_id=repo.store_id, store_url=repo.url, manifest=chain.target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path, source


__all__ = ["PullResult", "pull", "local_version", "resolve_version"]
