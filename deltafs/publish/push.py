"""Trainer side: checkpoint in → chunks, then manifest (the commit), then HEAD.

The pusher encodes against a local copy of the store's HEAD version (the push cache, a deltafs-
managed directory like a pull DEST). It writes that copy as it reads the source, so the next push
finds its base without reading the store. If the cache is missing, stale (another writer, a
restarted trainer) or corrupt, it is re-derived from the store with a pull: a delta is only ever
encoded against bytes that readers can rebuild.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import xxhash

from deltafs import codec
from deltafs.errors import DeltafsError, IntegrityError, LockHeldError, UsageError, VersionConflictError
from deltafs.format.manifest import ChunkRef, FileEntry, Head, Manifest, Segment, canonical_json
from deltafs.format.versions import check_version
from deltafs.read.pull import checked_head
from deltafs.read.dest import LocalCheckpoint, LocalState
from deltafs.parallel import default_threads, ordered_map
from deltafs.progress import Progress
from deltafs.read.rebuild import LocalBaseError
from deltafs.publish.source import SourceFile, SourceSegment, scan_source
from deltafs.store.objects import LocalObjectStore
from deltafs.store.repo import Repository, utcnow

# Keyframe policy defaults: a full version every 50 versions, or sooner once the deltas since the
# last full version add up to the size of a full version (a reader then reads at most ~2x full).
DEFAULT_KEYFRAME_EVERY = 50
DEFAULT_KEYFRAME_BUDGET = 1.0


class ReusedChunksGoneError(VersionConflictError):
    """A gc removed chunks that this push had found already in the store (deduplicated)."""


@dataclass(frozen=True)
class PushResult:
    version: int
    kind: str
    parent: int | None
    bytes_written: int  # new bytes stored for this version: chunks plus manifest
    full_bytes: int  # size of the checkpoint's files
    chunks_written: int
    changed_fraction: float  # elements that differ from the parent version
    seconds: float
    store: str
    base_rederived: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    fold_bytes: int = 0  # bytes of the folded delta written after the commit (push(..., fold=True))

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ratio"] = round(self.full_bytes / self.bytes_written, 2) if self.bytes_written else None
        return out


def default_cache_dir(store_id: str) -> str:
    root = os.environ.get("DELTAFS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "deltafs")
    return os.path.join(root, "push", store_id)


def push(store: str | Repository, src: str, *, version: int | None = None, metadata: Mapping[str, Any] | None = None,
         storage_options: dict[str, Any] | None = None, cache_dir: str | None = None, progress: bool = False,
         level: int = codec.DEFAULT_LEVEL, threads: int | None = None, full: bool = False,
         keyframe_every: int | None = DEFAULT_KEYFRAME_EVERY,
         keyframe_budget: float | None = DEFAULT_KEYFRAME_BUDGET, fold: bool = False,
         include: Sequence[str] | None = None, exclude: Sequence[str] | None = None,
         default_excludes: bool = True) -> PushResult:
    """Publish the checkpoint at src (a directory or a .safetensors file) as the store's next version.

    fold=True also writes, for a delta two or more steps past its full version, a folded delta from
    that full version straight to the new version (deltafs.read.folds), so lagging readers take one step.
    """
    t0 = time.monotonic()
    if version is not None:
        check_version(version)  # before anything is written: a bad number never reaches the store
    meta = dict(metadata or {})
    try:
        canonical_json(meta)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"metadata is not JSON: {exc}") from None
    files = scan_source(src, include=include, exclude=exclude, default_excludes=default_excludes)  # before touching the store: a bad source writes nothing
    repo = store if isinstance(store, Repository) else Repository.open(store, storage_options, create=True)
    head = checked_head(repo)  # a HEAD naming a missing or different manifest is reported as such
    if version is not None and head is not None and version <= head.version:
        raise UsageError(f"version {version} is not newer than the store's newest version {head.version}")
    new_version = check_version(version if version is not None else (head.version + 1 if head else 1))
    cache_root = cache_dir or default_cache_dir(repo.store_id)
    cache = LocalCheckpoint(os.path.join(cache_root, "base"))
    with cache.lock(wait=False, name="push.lock"):
        rederived = rederive = False
        for attempt in range(3):
            base = _base_for(repo, cache, head, rederive=rederive)
            rederived = rederived or base[1]
            try:
                res = _push_once(repo, files, cache, base[0], head, new_version, meta, level,
                                 threads or default_threads(), full, keyframe_every, keyframe_budget, progress, t0, rederived)
                if fold:
                    res = replace(res, fold_bytes=_fold_after_commit(repo, files, cache, cache_root, level,
                                                                     threads or default_threads()))
                return res
            except LocalBaseError:
                if rederive:
                    raise
                rederive = True
                _drop_cache(cache)
            except ReusedChunksGoneError:
                if attempt == 2:
                    raise
                # A gc removed chunks this push found already stored: encode again, writing them anew.
    raise AssertionError("unreachable")


def _base_for(repo: Repository, cache: LocalCheckpoint, head: Head | None, *, rederive: bool) -> tuple[LocalState | None, bool]:
    """The push cache's state if it holds HEAD; otherwise rebuild it from the store."""
    if head is None:
        return None, False
    state = cache.state()
    if not rederive and state is not None and state.store_id == repo.store_id and state.version == head.version \
            and state.digest == head.digest:
        return state, False
    from deltafs.read.pull import pull

    pull(repo, cache.dest, version=head.version, force=True, keep=1)
    state = cache.state()
    assert state is not None
    return state, True


def _drop_cache(cache: LocalCheckpoint) -> None:
    if os.path.islink(cache.dest):
        os.unlink(cache.dest)
    cache.cleanup(keep=0)


def _push_once(repo: Repository, files: list[SourceFile], cache: LocalCheckpoint, base: LocalState | None,
               head: Head | None, new_version: int, meta: dict[str, Any], level: int, threads: int, force_full: bool,
               keyframe_every: int | None, keyframe_budget: float | None, progress: bool, t0: float,
               rederived: bool) -> PushResult:
    parent = base.manifest if base is not None else None
    full_bytes = sum(f.size for f in files)
    kind = "full" if parent is None or force_full or _keyframe_due(parent, full_bytes, keyframe_every, keyframe_budget) else "delta"
    encoder = _Encoder(repo, base if kind == "delta" else None, level, threads, cache)
    with Progress(f"push v{new_version}", full_bytes, enabled=progress) as bar:
        entries = encoder.encode_files(files, bar.advance)
    try:
        man, manifest_size = commit_version(
            repo, version=new_version, kind=kind, parent=parent, head_seen=head, files=entries, metadata=meta,
            stored=encoder.stored, chunks_total=encoder.chunks_total, chunks_stored=encoder.chunks_written,
            elements_total=encoder.elements_total, elements_changed=encoder.elements_changed, reused=encoder.reused)
    except BaseException:
        encoder.discard_staging()
        raise
    encoder.install_cache(man)
    changed = encoder.elements_changed / encoder.elements_total if encoder.elements_total else 0.0
    return PushResult(
        version=new_version,
        kind=kind,
        parent=man.parent,
        bytes_written=encoder.stored + manifest_size,
        full_bytes=full_bytes,
        chunks_written=encoder.chunks_written,
        changed_fraction=changed if kind == "delta" else 1.0,
        seconds=time.monotonic() - t0,
        store=repo.url,
        base_rederived=rederived,
        metadata=meta,
    )


def commit_version(repo: Repository, *, version: int, kind: str, parent: Manifest | None, head_seen: Head | None,
                   files: list[FileEntry], metadata: dict[str, Any], stored: int, chunks_total: int, chunks_stored: int,
                   elements_total: int, elements_changed: int, reused: set[str],
                   extra_stats: Mapping[str, Any] | None = None) -> tuple[Manifest, int]:
    """Seal a new version's manifest and commit it; the one commit path of single- and multi-rank pushes.

    Every chunk must already be durable. Returns the manifest and its size in bytes.
    """
    stats: dict[str, Any] = {
        "full_bytes": sum(f.size for f in files),
        "chunk_bytes_stored": stored,
        "chunks_total": chunks_total,
        "chunks_stored": chunks_stored,
        "elements_total": elements_total,
        "elements_changed": elements_changed,
        # Delta bytes since the last full version (0 for a full version): what the keyframe budget compares.
        "chain_bytes": stored + int(parent.stats.get("chain_bytes", 0)) if kind == "delta" and parent else 0,
        "since_full": int(parent.stats.get("since_full", 0)) + 1 if kind == "delta" and parent else 0,
        **(extra_stats or {}),
    }
    man = Manifest(
        store_id=repo.store_id,
        version=version,
        parent=parent.version if parent else None,
        parent_digest=parent.digest if parent else None,
        kind=kind,
        chunk_bytes=repo.config.chunk_bytes,
        created=utcnow(),
        files=tuple(files),
        metadata=metadata,
        stats=stats,
    ).seal()
    wait_out_gc(repo, reused)
    now = repo.head()
    if (now is None) != (head_seen is None) or (now is not None and head_seen is not None and now.digest != head_seen.digest):
        raise VersionConflictError(
            f"HEAD of {repo.url} moved to version {now.version if now else None} during this push; another writer is publishing"
        )
    return man, repo.commit(man)


# How long a push waits for a running gc before giving up (a gc of a large store takes minutes).
GC_WAIT_SECONDS = 900.0


def wait_out_gc(repo: Repository, reused: set[str], *, timeout: float = GC_WAIT_SECONDS) -> None:
    """Before committing, make sure the chunks this push deduplicated against still exist.

    A gc may delete an old unreferenced chunk that this push found in the store instead of writing it.
    Fresh chunks are safe (gc spares objects younger than its grace period), and gc looks at the
    manifests again after a settle time before it deletes chunks, so a push that commits right after
    this check is seen. Here: wait while a gc holds its lock, then check that every reused chunk is
    still there; raise ReusedChunksGoneError (the caller encodes again) if one is gone.
    """
    if not reused:
        return
    from deltafs.store.lock import is_stale, read_lock

    deadline = time.monotonic() + timeout
    while (holder := read_lock(repo.objects)) is not None and not is_stale(holder):
        if time.monotonic() > deadline:
            raise LockHeldError(f"a gc has held {repo.url} for {holder.age:.0f}s ({holder.describe()}); push again later")
        time.sleep(0.5)
    ids = sorted(reused)
    missing = [oid for oid, ok in zip(ids, ordered_map(repo.has_chunk, ids, 8)) if not ok]
    if missing:
        raise ReusedChunksGoneError(f"a gc removed {len(missing)} chunks this push reused (e.g. {missing[0]})")


def _keyframe_due(parent: Manifest, full_bytes: int, every: int | None, budget: float | None) -> bool:
    since = int(parent.stats.get("since_full", 0))
    if every is not None and every > 0 and since + 1 >= every:
        return True
    chain = int(parent.stats.get("chain_bytes", 0))
    return budget is not None and budget > 0 and chain >= budget * full_bytes


class _Encoder:
    """Encodes files chunk by chunk in a thread pool and writes the new push cache as it goes."""

    def __init__(self, repo: Repository, base: LocalState | None, level: int, threads: int, cache: LocalCheckpoint,
                 *, write_cache: bool = True) -> None:
        self.repo = repo
        self.write_cache = write_cache  # False: only encode (a fold), do not keep a copy of the bytes
        self.base = base
        self.base_segments = base.manifest.segments() if base else {}
        self.level = level
        self.threads = threads
        self.cache = cache
        self.cb = repo.config.chunk_bytes
        self.staging = cache.new_staging()
        self.stored = self.chunks_written = self.chunks_total = 0
        self.reused: set[str] = set()  # chunks already in the store (deduplicated), see wait_out_gc
        self.elements_total = self.elements_changed = 0
        # Remote stores are latency-bound: many uploads in flight; a local disk is fsync-bound.
        self.io_threads = 4 if isinstance(repo.objects, LocalObjectStore) else 16
        self._inflight = threading.BoundedSemaphore(32)
        self._pending_lock = threading.Lock()

    def discard_staging(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)

    def install_cache(self, man: Manifest) -> None:
        self.cache.install(self.staging, store_id=self.repo.store_id, store_url=self.repo.url, manifest=man)
        self.cache.cleanup(keep=1)

    def _base_of(self, seg: SourceSegment) -> tuple[str, Segment] | None:
        if self.base is None:
            return None
        hit = self.base_segments.get(seg.key)
        if hit is None:
            return None
        bfile, bseg = hit
        if bseg.kind != seg.kind or bseg.size != seg.size or bseg.itemsize != seg.itemsize:
            return None
        return os.path.join(self.base.path, bfile.path), bseg

    def encode_files(self, files: list[SourceFile], advance: Any) -> list[FileEntry]:
        """Encode every file; returns once every chunk object it wrote is durable in the store."""
        io_pool = ThreadPoolExecutor(max_workers=self.io_threads, thread_name_prefix="deltafs-put")
        pending: list[tuple[str, int, Future[bool]]] = []
        try:
            entries = [self._encode_file(f, advance, io_pool, pending) for f in files]
            for oid, size, fut in pending:
                if fut.result():
                    self.stored += size
                else:
                    self.reused.add(oid)
            return entries
        except BaseException:
            for _oid, _size, fut in pending:
                fut.cancel()
            self.discard_staging()
            raise
        finally:
            io_pool.shutdown(wait=True)

    def _put(self, oid: str, payload: bytes) -> bool:
        try:
            return self.repo.put_chunk(payload, oid=oid)[1]
        finally:
            self._inflight.release()

    def _encode_file(self, f: SourceFile, advance: Any, io_pool: ThreadPoolExecutor,
                     pending: list[tuple[str, int, Future[bool]]]) -> FileEntry:
        out_path = os.path.join(self.staging, f.path)
        os.makedirs(os.path.dirname(out_path), exist_ok=True)
        fhash = hashlib.sha256()
        bases = {seg.key: self._base_of(seg) for seg in f.segments}
        base_fds: dict[str, int] = {}
        with contextlib.ExitStack() as stack:
            src = stack.enter_context(open(f.abspath, "rb"))
            for hit in bases.values():
                if hit is not None and hit[0] not in base_fds:
                    base_fds[hit[0]] = stack.enter_context(open(hit[0], "rb")).fileno()
            out = stack.enter_context(open(out_path, "wb") if self.write_cache else _Sink())

            def work(task: tuple[SourceSegment, int]) -> tuple[bytes, bytes | None, codec.Encoded, str | None]:
                seg, i = task
                start = i * self.cb
                size = min(self.cb, seg.size - start)
                new = os.pread(src.fileno(), size, seg.offset + start)
                if len(new) != size:
                    raise DeltafsError(f"{f.abspath} shrank while it was being pushed")
                old = None
                hit = bases[seg.key]
                if hit is not None:
                    old = os.pread(base_fds[hit[0]], size, hit[1].offset + start)
                    if len(old) != size:
                        raise LocalBaseError("push cache file is truncated")
                enc = codec.encode(np.frombuffer(new, np.uint8), None if old is None else np.frombuffer(old, np.uint8),
                                   seg.itemsize, level=self.level)
                oid = None
                if enc.payload is not None:
                    # Uploads run in their own pool, so store latency overlaps encoding; the semaphore
                    # bounds the payload bytes waiting for it.
                    oid = hashlib.sha256(enc.payload).hexdigest()
                    self._inflight.acquire()
                    pending_put = io_pool.submit(self._put, oid, enc.payload)
                    with self._pending_lock:
                        pending.append((oid, len(enc.payload), pending_put))
                return new, old, enc, oid

            tasks = ((seg, i) for seg in f.segments for i in range((seg.size + self.cb - 1) // self.cb))
            results = ordered_map(work, tasks, self.threads, self.threads * 2)
            try:
                segments = [self._collect_segment(seg, bases[seg.key], results, out, fhash, advance) for seg in f.segments]
            finally:
                results.close()
            out.flush()
            if self.write_cache:
                os.fsync(out.fileno())
            size = out.tell()
        if size != f.size:
            raise DeltafsError(f"{f.abspath} changed size while it was being pushed")
        return FileEntry(f.path, f.size, fhash.hexdigest(), f.format, tuple(segments))

    def _collect_segment(self, seg: SourceSegment, hit: tuple[str, Segment] | None,
                         results: Iterator[tuple[bytes, bytes | None, codec.Encoded, str | None]], out: Any, fhash: Any,
                         advance: Any) -> Segment:
        """Take this segment's chunks from the ordered results: write the cache copy, hash, record."""
        shash = xxhash.xxh3_128()
        bhash = xxhash.xxh3_128()
        chunks = []
        for i in range((seg.size + self.cb - 1) // self.cb):
            new, old, enc, oid = next(results)
            out.write(new)
            fhash.update(new)
            shash.update(new)
            if old is not None:
                bhash.update(old)
            stored = len(enc.payload) if enc.payload is not None else 0
            if enc.payload is not None:
                self.chunks_written += 1
            self.chunks_total += 1
            if seg.kind == "tensor":
                self.elements_total += len(new) // seg.itemsize
                self.elements_changed += enc.changed
            chunks.append(ChunkRef(index=i, size=len(new), codec=enc.codec, object=oid, stored=stored))
            advance(len(new))
        if hit is not None and "xxh3-128:" + bhash.hexdigest() != hit[1].digest:
            raise LocalBaseError(f"push cache does not match version {self.base.version if self.base else '?'} at {seg.key[2:]}")
        return Segment(key=seg.key, kind=seg.kind, offset=seg.offset, size=seg.size,
                       digest="xxh3-128:" + shash.hexdigest(), chunks=tuple(chunks), dtype=seg.dtype, shape=seg.shape)


class _Sink(io.RawIOBase):
    """Counts the bytes written to it and keeps none (encoding without a cache copy)."""

    def __init__(self) -> None:
        self.n = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        self.n += size
        return size

    def tell(self) -> int:
        return self.n


# --- folded deltas -------------------------------------------------------------------------------
def _fold_after_commit(repo: Repository, files: list[SourceFile], cache: LocalCheckpoint, cache_root: str,
                       level: int, threads: int) -> int:
    """Keep the keyframe cache current, and write the fold of the version just committed.

    The version is already committed: a fold that cannot be written is logged and skipped.
    Returns the bytes written for the fold (chunks plus its manifest).
    """
    from deltafs.read.folds import fold_key, is_fold_of
    from deltafs.read.rebuild import plan_chain

    state = cache.state()
    if state is None:
        return 0
    man = state.manifest
    keyframe = LocalCheckpoint(os.path.join(cache_root, "keyframe"))
    try:
        if man.kind == "full":
            _link_keyframe(repo, state, keyframe)
            return 0
        if int(man.stats.get("since_full", 0)) < 2:
            return 0  # the chain from the full version is this delta alone (or one more): nothing to fold
        full = plan_chain(repo, man.version, None).steps[0]
        kstate = keyframe.state()
        if kstate is None or kstate.store_id != repo.store_id or kstate.digest != full.digest:
            from deltafs.read.pull import pull

            pull(repo, keyframe.dest, version=full.version, force=True, keep=1)
            kstate = keyframe.state()
            assert kstate is not None
        enc = _Encoder(repo, kstate, level, threads, keyframe, write_cache=False)
        try:
            entries = enc.encode_files(files, lambda n: None)
        except LocalBaseError:
            _drop_cache(keyframe)  # rebuilt from the store next time
            raise
        finally:
            enc.discard_staging()
        stats = {"fold_of": man.digest, "full_bytes": man.raw_bytes, "chunk_bytes_stored": enc.stored,
                 "chunks_total": enc.chunks_total, "chunks_stored": enc.chunks_written,
                 "elements_total": enc.elements_total, "elements_changed": enc.elements_changed}
        folded = Manifest(store_id=repo.store_id, version=man.version, parent=full.version, parent_digest=full.digest,
                          kind="delta", chunk_bytes=man.chunk_bytes, created=utcnow(), files=tuple(entries),
                          metadata=man.metadata, stats=stats).seal()
        if not is_fold_of(folded, man):
            raise DeltafsError("the source changed after the version was committed")
        wait_out_gc(repo, enc.reused)
        data = folded.to_bytes()
        repo.objects.put_if_absent(fold_key(man.version), data)  # after its chunks, like a commit
        return enc.stored + len(data)
    except (DeltafsError, OSError) as exc:
        import logging

        logging.getLogger("deltafs").warning("version %s is committed, but its fold was not written: %s", man.version, exc)
        return 0


def _link_keyframe(repo: Repository, state: LocalState, keyframe: LocalCheckpoint) -> None:
    """Make the keyframe cache a copy of the full version just pushed (hard links: no extra disk)."""
    staging = keyframe.new_staging()
    try:
        for f in state.manifest.files:
            src, dst = os.path.join(state.path, f.path), os.path.join(staging, f.path)
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


# --- tensors from Python ---------------------------------------------------------------------------
DEFAULT_SHARD_BYTES = 5 << 30


def write_hf_checkpoint(tensors: Mapping[str, Any], out_dir: str, *, extra_files: Mapping[str, bytes] | None = None,
                        max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """Serialize name → torch tensor (any device, any layout) as HF-style safetensors shards."""
    import torch
    from safetensors.torch import save_file

    shards: list[dict[str, Any]] = [{}]
    size = 0
    seen_storage: set[int] = set()
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise UsageError(f"{name} is not a torch.Tensor")
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr() if t.numel() else 0
        if ptr and ptr in seen_storage:
            t = t.clone()  # tied weights: safetensors refuses shared storage
        seen_storage.add(ptr)
        nb = t.numel() * t.element_size()
        if shards[-1] and size + nb > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nb
    os.makedirs(out_dir, exist_ok=True)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        total = 0
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
            for name, t in shard.items():
                weight_map[name] = fname
                total += t.numel() * t.element_size()
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as fh:
            json.dump(index, fh, indent=2, sort_keys=True)
    for rel, data in (extra_files or {}).items():
        path = os.path.join(out_dir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(data)


def push_tensors(store: str | Repository, tensors: Mapping[str, Any], *, extra_files: Mapping[str, bytes] | None = None,
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES, **kwargs: Any) -> PushResult:
    """Publish a mapping of HF names to torch tensors (plus files such as config.json) as the next version."""
    tmp_root = kwargs.pop("tmp_dir", None)
    with tempfile.TemporaryDirectory(prefix="deltafs-push-", dir=tmp_root) as tmp:
        write_hf_checkpoint(tensors, tmp, extra_files=extra_files, max_shard_bytes=max_shard_bytes)
        return push(store, tmp, **kwargs)


__all__ = ["PushResult", "push", "push_tensors", "write_hf_checkpoint", "IntegrityError"]
