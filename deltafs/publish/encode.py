"""Encode a source's files against a base: chunks to the store, file entries for the manifest, the new push cache.

Work per chunk (read, compare and encode, hash the payload, store it) runs in a thread pool; what
must see a file's bytes in order (its v1 digests: SHA-256 of the file, XXH3 of each segment and of
the base segment it is checked against) runs in one "lane" per file, several files at a time. Every
step keeps to code that releases the GIL (os.pread, numpy, zstd, hashlib, xxhash). Memory is
bounded: each lane has at most `window` chunks in flight, and at most MAX_PUT_QUEUE payloads wait
for the store.

The push cache takes the new version in one of two ways. Patching (patch=True): the stage directory
is the previous version's own directory and each file has the base's layout, so the workers write
only the chunks that changed into it, at their offsets, from the bytes they read anyway (no copy of
the unchanged bytes). Otherwise each file is placed without reading it through Python: a reflink
(copy-on-write clone) or a hard link, else an in-kernel copy (copy_file_range); an in-memory file
(push_tensors) is written by the workers at the chunks' offsets as they go.

The cache is not fsynced: every push checks each base chunk it reads against the cache's manifest
(LocalBaseError, and the base is rebuilt from the store), so a cache torn by a crash costs a rebuild,
never a wrong delta.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import shutil
import stat
import threading
from collections import deque
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash

from deltafs import codec
from deltafs.buffers import aligned_empty, cut_short, faulted, is_mapped, mapped_end, mapped_range, pread_aligned
from deltafs.errors import DeltafsError, ObjectNotFoundError, SourceError
from deltafs.format import digests
from deltafs.format.manifest import ChunkRef, FileEntry, Segment
from deltafs.publish.source import DiskReader, FileReader, SourceFile, SourceSegment
from deltafs.read.dest import LocalState
from deltafs.read.rebuild import LocalBaseError, pwrite_all
from deltafs.store.local import is_network_fs, mount_fstype
from deltafs.store.repo import Repository

MAX_PUT_QUEUE = 32  # runs of encoded payloads waiting for the store, at most
SMALL_CHUNK = 256 << 10  # chunks up to this size are read as plain bytes and batched into runs
MAX_RUN = 64  # small chunks per run, at most
_FICLONE = 0x40049409  # linux/fs.h: clone a whole file (btrfs, XFS, bcachefs, overlayfs on those)


@dataclass
class EncodeStats:
    """What one encoder (one rank) wrote and saw; summed over ranks for the manifest's stats."""

    stored: int = 0  # payload bytes newly written to the store
    chunks_written: int = 0
    chunks_total: int = 0
    elements_total: int = 0
    elements_changed: int = 0
    reused: set[str] = field(default_factory=set)  # chunks found already stored (deduplicated)

    def add(self, other: EncodeStats) -> None:
        self.stored += other.stored
        self.chunks_written += other.chunks_written
        self.chunks_total += other.chunks_total
        self.elements_total += other.elements_total
        self.elements_changed += other.elements_changed
        self.reused |= other.reused


def place_file(src: str, dst: str, *, allow_link: bool) -> str:
    """Give dst the bytes of src without reading them through Python; returns how: reflink, link or copy."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        try:
            fcntl.ioctl(fout.fileno(), _FICLONE, fin.fileno())
            return "reflink"
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EPERM):
                raise
        if not allow_link:
            _kernel_copy(fin.fileno(), fout.fileno(), os.fstat(fin.fileno()).st_size)
            os.fsync(fout.fileno())
            return "copy"
    os.unlink(dst)
    try:
        os.link(src, dst)
        return "link"
    except OSError:
        pass
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        _kernel_copy(fin.fileno(), fout.fileno(), os.fstat(fin.fileno()).st_size)
        os.fsync(fout.fileno())
    return "copy"


def _kernel_copy(fin: int, fout: int, size: int) -> None:
    done = 0
    try:
        while done < size:
            n = os.copy_file_range(fin, fout, size - done, done, done)
            if n == 0:
                break
            done += n
    except OSError:
        os.lseek(fin, done, os.SEEK_SET)
        os.lseek(fout, done, os.SEEK_SET)
        while block := os.read(fin, 8 << 20):
            os.write(fout, block)
        return
    if done != size:
        raise SourceError(f"copy of {size} bytes stopped at {done}: the file shrank while it was being pushed")


class Encoder:
    """Encodes files against a base (None: a full version) and writes their chunks to the store.

    stage_dir: where the new push cache is assembled (None: encode only, e.g. a fold).
    """

    def __init__(self, repo: Repository, base: LocalState | None, *, level: int, threads: int,
                 stage_dir: str | None, full_level: int | None = None, allow_link: bool = True, patch: bool = False,
                 versions: tuple[tuple[str, int, str] | None, tuple[str, int]] | None = None) -> None:
        self.repo = repo
        self.base = base
        self.base_segments = base.manifest.segments() if base else {}
        self.level = level
        self.full_level = level if full_level is None else full_level  # chunks with no base (deltafs.defaults)
        self.threads = max(1, threads)
        self.stage_dir = stage_dir
        self.allow_link = allow_link
        # stage_dir is base.path: each file is the base's, same layout (see patchable()); write what changed.
        self.patch = patch
        # A push's own encode: (its base version, the version it writes), each (store id, version), so a
        # DeviceBaseline holding that base may rebuild range reads from it (publish.device_diff). None: a fold.
        self.versions = versions
        self.cb = repo.config.chunk_bytes
        self.stats = EncodeStats()
        # Remote stores are latency-bound: many uploads in flight; a local disk is fsync-bound.
        self.io_threads = min(4, repo.objects.capabilities.concurrency) if repo.objects.local_root else 16
        self._put_slots = threading.BoundedSemaphore(MAX_PUT_QUEUE)
        self._lock = threading.Lock()
        self._failed = threading.Event()
        self._free: list[np.ndarray] = []  # read buffers; at most 2 per chunk in flight exist (bounded by the windows)
        self._mapped: set[int] = set()  # fds whose large chunks are read as views of the page cache (_mappable)

    def encode(self, files: list[SourceFile], advance: Callable[[int], None] = lambda n: None) -> list[FileEntry]:
        """Encode every file; returns once every chunk object it wrote is durable in the store."""
        lanes = max(1, min(len(files), 4, self.threads))
        window = max(2, (2 * self.threads) // lanes + 1)
        puts: list[tuple[list[tuple[str, int]], Future[list[bool]]]] = []
        placing: list[Future[None]] = []
        work = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="deltafs-encode")
        io = ThreadPoolExecutor(max_workers=self.io_threads, thread_name_prefix="deltafs-put")
        lane_pool = ThreadPoolExecutor(max_workers=lanes, thread_name_prefix="deltafs-lane")
        ctx = _Context(work, io, puts, placing, window, advance)
        try:
            # Biggest files first, so a large shard is not left to run alone at the end.
            order = sorted(range(len(files)), key=lambda i: -files[i].size)
            futures = {i: lane_pool.submit(self._encode_file, files[i], ctx) for i in order}
            wait(futures.values(), return_when=FIRST_EXCEPTION)
            entries = [futures[i].result() for i in range(len(files))]
            for fut in placing:
                fut.result()
            for batch, put in puts:
                for (oid, size), new in zip(batch, put.result(), strict=True):
                    if new:
                        self.stats.stored += size
                    else:
                        self.stats.reused.add(oid)
            return entries
        except BaseException:
            self._failed.set()
            for _batch, put in puts:
                put.cancel()
            raise
        finally:
            lane_pool.shutdown(wait=True)
            work.shutdown(wait=True, cancel_futures=True)
            io.shutdown(wait=True)

    # --- one file -------------------------------------------------------------------------
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

    def _encode_file(self, f: SourceFile, ctx: _Context) -> FileEntry:
        stage_fd = self._stage(f, ctx)
        reader = f.open()
        bases = {seg.key: self._base_of(seg) for seg in f.segments}
        base_fds: dict[str, int] = {}
        try:
            if isinstance(reader, DiskReader) and _mappable(reader.fd, f.abspath):
                self._mapped.add(reader.fd)
            map_bases = may_map_bases(self.patch, [hit[1] for hit in bases.values() if hit is not None])
            for hit in bases.values():
                if hit is not None and hit[0] not in base_fds:
                    fd = base_fds[hit[0]] = os.open(hit[0], os.O_RDONLY)
                    if map_bases and _mappable(fd, hit[0]):
                        self._mapped.add(fd)
            lane = _Lane(self, f, reader, bases, base_fds, stage_fd, ctx)
            entry = lane.run()
            if isinstance(reader, DiskReader) and (reader.stamp[0] != f.size or reader.written_since_open()):
                # Every chunk is read: a file written meanwhile (in place, at the same size, so no read came back
                # short) may have given some chunks of each version, which no digest would show.
                raise SourceError(f"{f.abspath} was written while it was being pushed: a checkpoint must not change "
                                  "until its push returns")
            return entry
        finally:
            # Forgotten before they are closed: a number reused by another lane's open is not taken for mappable.
            self._mapped.discard(getattr(reader, "fd", -1))
            self._mapped.difference_update(base_fds.values())
            reader.close()
            for fd in base_fds.values():
                os.close(fd)
            if stage_fd is not None:
                os.close(stage_fd)

    def _stage(self, f: SourceFile, ctx: _Context) -> int | None:
        """Start the cache copy of f: placed in the background (a file on disk) or an fd the workers fill."""
        if self.stage_dir is None:
            return None
        dst = os.path.join(self.stage_dir, f.path)
        if self.patch:
            return os.open(dst, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)  # the base file itself
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if f.pieces is None:
            def place() -> None:
                place_file(f.abspath, dst, allow_link=self.allow_link)
            ctx.placing.append(ctx.io.submit(place))
            return None
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(fd, f.size)
        return fd

    def _chunk(self, reader: FileReader, seg: SourceSegment, i: int, base_fd: int | None, base_offset: int,
               stage_fd: int | None, given: tuple[memoryview, memoryview | None] | None = None) -> _Chunk:
        """One chunk: read it (and its base), encode, hash; _chunks names and stores the payload. Runs in a worker.

        given: (new, base) bytes of this chunk, read already with the rest of its run (base None: read it here)."""
        if self._failed.is_set():
            raise DeltafsError("push aborted")
        start = i * self.cb
        size = min(self.cb, seg.size - start)
        held: list[np.ndarray] = []
        old = None
        known = None
        if base_fd is not None:
            old = given[1] if given is not None and given[1] is not None else \
                self._read(base_fd, size, base_offset + start, held)
            if len(old) != size:
                raise LocalBaseError("push cache file is truncated")
        if given is not None:
            new: Any = given[0]
        elif isinstance(reader, DiskReader):
            new = self._read(reader.fd, size, seg.offset + start, held)
        elif reader.copies(seg.offset + start):
            # An accelerator's bytes, copied; with a DeviceBaseline that holds the base version, rebuilt from the
            # base and the changed elements, which the codec then need not look for.
            out = self._take(held) if size > SMALL_CHUNK else None
            new, known = reader.read_against(seg.offset + start, size, out, old, self.versions)
        else:
            new = reader.read(seg.offset + start, size)
        if len(new) != size:
            raise _shrank(reader, seg)
        # A host tensor is read in place (a view, no copy): one written meanwhile (an optimizer step overlapping
        # push_tensors) would leave a payload and a digest of different bytes, a version no reader can rebuild. Its
        # digest is taken before the encode and again after the last use of its bytes; they must agree.
        before = digests.chunk_digest(new) if given is None and not isinstance(reader, DiskReader) \
            and not reader.copies(seg.offset + start) else None
        enc = codec.encode(np.frombuffer(new, np.uint8), None if old is None else np.frombuffer(old, np.uint8),
                           seg.itemsize, level=self.level, known=known, full_level=self.full_level)
        # Digests per chunk, here in the workers: nothing hashes a whole file serially (format v2). The base's
        # digest is taken before a patch overwrites it.
        digest = before if before is not None else digests.chunk_digest(new)
        base_digest = digests.chunk_digest(old) if old is not None else None
        if given is None:  # (a run's chunks share one mapping, which _chunks checks once for them all)
            _check_views(reader, seg, new, old)  # nothing above is used if a mapped file was cut short meanwhile
        if stage_fd is not None and not (self.patch and old is not None and enc.changed == 0):
            try:
                pwrite_all(stage_fd, memoryview(new), seg.offset + start)
            except OSError as exc:  # the kernel's copy from a mapping cut short since: EFAULT, not SIGBUS
                if exc.errno == errno.EFAULT and is_mapped(new):
                    raise _shrank(reader, seg) from None
                raise
        if before is not None and digests.chunk_digest(new) != before:  # once more, after the encode and the copy
            raise SourceError(f"tensor {seg.key[2:]} changed while it was being pushed (chunk {i}): the tensors "
                              "must not change until push_tensors returns (push a copy, or push between steps)")
        return _Chunk(new, old, enc, held, digest, base_digest)

    def _chunks(self, reader: FileReader, run: list[tuple[SourceSegment, int, int | None, int]], stage_fd: int | None,
                ctx: _Context) -> list[_Chunk]:
        """A run of chunks of one file: one chunk, or several small ones (tiny tensors), as one task and one stored
        object, so a model of thousands of small tensors pays neither a thread hand-off nor a store write per tensor.

        The payloads of a run are stored as one object (a pack, format 3) when there are several: each chunk
        record then names the pack and where its payload lies in it.
        """
        pieces = self._run_reads(reader, run)
        out = [self._chunk(reader, seg, i, base_fd, base_offset, stage_fd, pieces[k] if pieces else None)
               for k, (seg, i, base_fd, base_offset) in enumerate(run)]
        if pieces:
            # The run's bytes are slices of one span (and its base's of another): one check after their last use
            # covers every chunk, as each chunk's own check would (one fstat per chunk hands the GIL over and
            # waits to take it back, a few us each on a model of thousands of tiny tensors). A failure here
            # discards the whole run, staged copies included: the push fails before anything names them.
            _check_views(reader, run[-1][0], pieces[0][0], next((old for _, old in pieces if old is not None), None))
        stored = [(c, c.enc.payload) for c in out if c.enc.payload is not None]
        batch: list[tuple[str, bytes]] = []
        if len(stored) == 1:
            c, payload = stored[0]
            c.oid = hashlib.sha256(payload).hexdigest()
            batch = [(c.oid, payload)]
        elif stored:
            # Identical payloads (zero tensors, tied copies) are stored once in the pack, as separate objects would be.
            offsets: dict[bytes, int] = {}
            at = 0
            for _, payload in stored:
                if payload not in offsets:
                    offsets[payload] = at
                    at += len(payload)
            blob = b"".join(offsets)  # a dict keeps insertion order: the distinct payloads at their offsets
            oid = hashlib.sha256(blob).hexdigest()
            for c, payload in stored:
                c.oid, c.pack = oid, (offsets[payload], len(blob))
            batch = [(oid, blob)]
        if batch:
            # Uploads run in their own pool, so store latency overlaps encoding; the semaphore bounds the
            # payload bytes waiting for it (a run holds at most chunk_bytes of them).
            self._put_slots.acquire()
            try:
                fut = ctx.io.submit(self._put_batch, batch)
            except BaseException:
                self._put_slots.release()
                raise
            with self._lock:
                ctx.puts.append(([(oid, len(payload)) for oid, payload in batch], fut))
        return out

    def _run_reads(self, reader: FileReader, run: list[tuple[SourceSegment, int, int | None, int]]
                   ) -> list[tuple[memoryview, memoryview | None]] | None:
        """The bytes of a run of several small chunks of a file on disk, and of their bases where those lie in one
        span of one file: one pread each instead of one per chunk (each read hands the GIL over and waits to take
        it back). None for a single chunk or another reader."""
        if len(run) < 2 or not isinstance(reader, DiskReader):
            return None
        spans = [(seg.offset + i * self.cb, min(self.cb, seg.size - i * self.cb), base_fd, base_offset + i * self.cb)
                 for seg, i, base_fd, base_offset in run]
        first, last = spans[0], spans[-1]
        total = last[0] + last[1] - first[0]
        if total != sum(s[1] for s in spans):
            return None  # not one span (cannot happen for segments that tile a file; checked, not assumed)
        new = self._read_span(reader.fd, total, first[0])
        if len(new) != total:
            raise _shrank(reader, run[0][0])
        # The bases, when those that exist lie in one file at the same distance from their chunks (the layout
        # did not move): one read from the first to the last of them. Otherwise each chunk reads its own.
        based = [s for s in spans if s[2] is not None]
        base: memoryview | None = None
        if based and all(s[2] == based[0][2] and s[3] - s[0] == based[0][3] - based[0][0] for s in based):
            lo, hi = based[0][3], based[-1][3] + based[-1][1]
            base = self._read_span(based[0][2], hi - lo, lo)  # type: ignore[arg-type]
            if len(base) != hi - lo:
                raise LocalBaseError("push cache file is truncated")
        out = []
        for offset, size, fd, base_at in spans:
            at = offset - first[0]
            old = base[base_at - lo:base_at - lo + size] if base is not None and fd is not None else None
            out.append((new[at:at + size], old))
        return out

    def _read(self, fd: int, size: int, offset: int, held: list[np.ndarray]) -> Any:
        """A chunk's bytes: small ones as a plain read, others as a view of the page cache where the file allows
        (_view), else into a recycled chunk-sized buffer. Short where the file is."""
        if size <= SMALL_CHUNK:
            return os.pread(fd, size, offset)
        view = self._view(fd, size, offset)
        return view if view is not None else self._read_into(fd, size, offset, held)

    def _read_span(self, fd: int, size: int, offset: int) -> memoryview:
        """A run's bytes (small chunks read together): as _read, without a recycled buffer (a run's span varies)."""
        view = self._view(fd, size, offset) if size > SMALL_CHUNK else None
        return view if view is not None else memoryview(os.pread(fd, size, offset))

    def _view(self, fd: int, size: int, offset: int) -> memoryview | None:
        """size bytes of fd at offset through a mapping (deltafs.buffers.mapped_range), or None (read them instead).

        A 4 MiB chunk costs the kernel ~0.2 ms to map against ~0.8 ms to copy into a buffer (the compare and the
        digests then read slower memory, and still the push's worker time falls: docs/profile.md, round 16).
        Below SMALL_CHUNK a read is cheaper than a mapping's set-up. An EOFError (the file is shorter now) is an
        empty view: the caller's length check names the file.
        """
        if fd not in self._mapped:
            return None
        try:
            return mapped_range(fd, size, offset)
        except EOFError:
            return memoryview(b"")

    def _read_into(self, fd: int, size: int, offset: int, held: list[np.ndarray]) -> memoryview:
        """pread into a recycled page-aligned buffer: a fresh 4 MiB bytes object per read costs page faults, more
        than the read, and an unaligned one makes the kernel's copy up to 4x slower (deltafs.buffers)."""
        return pread_aligned(fd, size, offset, self._take(held)).data

    def _take(self, held: list[np.ndarray]) -> np.ndarray:
        """A recycled chunk-sized page-aligned buffer, held by the caller's chunk until recycle()."""
        with self._lock:
            buf = self._free.pop() if self._free else aligned_empty(self.cb)
        held.append(buf)
        return buf

    def recycle(self, held: list[np.ndarray]) -> None:
        if not held:
            return  # small chunks hold no buffer: no lock to take
        with self._lock:
            self._free.extend(held)

    def _put_batch(self, batch: list[tuple[str, bytes]]) -> list[bool]:
        """Store a run's payloads; for each, whether it was new (False: already stored, deduplicated)."""
        try:
            return [self._put(oid, payload) for oid, payload in batch]
        finally:
            self._put_slots.release()

    def _put(self, oid: str, payload: bytes) -> bool:
        for attempt in range(3):
            try:
                return self.repo.put_chunk(payload, oid=oid)[1]
            except ObjectNotFoundError:
                # A gc took this push for dead (frozen past its marker's ttl) and removed its partial
                # write: the write is idempotent, so write again.
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")


@dataclass
class _Chunk:
    """One encoded chunk, as a worker hands it back to its file's lane."""

    new: Any
    old: Any
    enc: codec.Encoded
    held: list[np.ndarray]
    digest: bytes  # format v2 chunk digest of new
    base_digest: bytes | None  # of old, to check the push cache against its manifest
    oid: str | None = None  # the stored object holding the payload (set by _chunks); None: nothing stored
    pack: tuple[int, int] | None = None  # (offset, object size) when the payload is stored in a pack


@dataclass
class _Context:
    work: ThreadPoolExecutor
    io: ThreadPoolExecutor
    puts: list[tuple[list[tuple[str, int]], Future[list[bool]]]]
    placing: list[Future[None]]
    window: int
    advance: Callable[[int], None]
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Lane:
    """One file: submits its chunks to the workers (at most `window` in flight) and takes them back in order."""

    def __init__(self, enc: Encoder, f: SourceFile, reader: FileReader, bases: dict[str, tuple[str, Segment] | None],
                 base_fds: dict[str, int], stage_fd: int | None, ctx: _Context) -> None:
        self.enc, self.f, self.reader, self.bases, self.base_fds = enc, f, reader, bases, base_fds
        self.stage_fd, self.ctx = stage_fd, ctx
        self.stats = EncodeStats()

    def _runs(self) -> Any:
        """The file's chunks in order, cut into runs: a chunk of chunk_bytes alone, small ones together up to
        chunk_bytes (or MAX_RUN chunks)."""
        cb = self.enc.cb
        run: list[tuple[SourceSegment, int, int | None, int]] = []
        run_bytes = 0
        for seg in self.f.segments:
            hit = self.bases[seg.key]
            base_fd = self.base_fds[hit[0]] if hit is not None else None
            base_offset = hit[1].offset if hit is not None else 0
            for i in range((seg.size + cb - 1) // cb):
                size = min(cb, seg.size - i * cb)
                if run and (size > SMALL_CHUNK or run_bytes + size > cb or len(run) >= MAX_RUN):
                    yield run
                    run, run_bytes = [], 0
                run.append((seg, i, base_fd, base_offset))
                run_bytes += size
                if size > SMALL_CHUNK:
                    yield run
                    run, run_bytes = [], 0
        if run:
            yield run

    def run(self) -> FileEntry:
        pending: deque[Future[list[_Chunk]]] = deque()

        def results() -> Any:
            for run in self._runs():
                pending.append(self.ctx.work.submit(self.enc._chunks, self.reader, run, self.stage_fd, self.ctx))
                if len(pending) >= self.ctx.window:
                    yield from pending.popleft().result()
            while pending:
                yield from pending.popleft().result()

        stream = results()
        try:
            segments = [self._segment(seg, stream) for seg in self.f.segments]
        finally:
            for fut in pending:
                fut.cancel()
        with self.ctx.lock:
            self.enc.stats.add(self.stats)
        return FileEntry(self.f.path, self.f.size, digests.file_digest([s.digest for s in segments], self.f.size),
                         self.f.format, tuple(segments))

    def _segment(self, seg: SourceSegment, stream: Any) -> Segment:
        """Take this segment's chunks in order: combine their digests, count, record."""
        cb = self.enc.cb
        hit = self.bases[seg.key]
        tree_base = hit is not None and digests.is_tree_digest(hit[1].digest)
        # A v1 base (a store written by deltafs 0.1) has one xxh3 stream per segment: hash it in order.
        bhash = xxhash.xxh3_128() if hit is not None and not tree_base else None
        chunk_digests: list[bytes] = []
        base_digests: list[bytes] = []
        chunks = []
        for i in range((seg.size + cb - 1) // cb):
            got = next(stream)
            new, old, enc, oid, held, pack = got.new, got.old, got.enc, got.oid, got.held, got.pack
            chunk_digests.append(got.digest)
            if got.base_digest is not None:
                base_digests.append(got.base_digest)
            if bhash is not None:
                bhash.update(old)
                if faulted(old):
                    raise LocalBaseError("push cache file was cut short while it was read")
            size = len(new)
            del new, old
            self.enc.recycle(held)  # the bytes are hashed: the buffers can take the next reads
            self.stats.chunks_total += 1
            if enc.payload is not None:
                self.stats.chunks_written += 1
            if seg.kind == "tensor":
                self.stats.elements_total += size // seg.itemsize
                self.stats.elements_changed += enc.changed
            chunks.append(ChunkRef(index=i, size=size, codec=enc.codec, object=oid,
                                   stored=len(enc.payload) if enc.payload is not None else 0, pack=pack))
            with self.ctx.lock:
                self.ctx.advance(size)
        base_ok = hit is None or hit[1].digest == (digests.segment_digest(base_digests, seg.size) if tree_base
                                                   else "xxh3-128:" + (bhash.hexdigest() if bhash else ""))
        if not base_ok:
            version = self.enc.base.version if self.enc.base else "?"
            raise LocalBaseError(f"push cache does not match version {version} at {seg.key[2:]}")
        return Segment(key=seg.key, kind=seg.kind, offset=seg.offset, size=seg.size,
                       digest=digests.segment_digest(chunk_digests, seg.size), chunks=tuple(chunks), dtype=seg.dtype,
                       shape=seg.shape)


def may_map_bases(patch: bool, base_segments: list[Segment]) -> bool:
    """Whether a file's base may be read through mappings (views that show later writes to the file).

    A patch writes each changed chunk into the base's own file after reading it; a v1 base segment (one xxh3
    stream, deltafs 0.1) is hashed by its lane after that write: through a view the hash would see the new
    bytes. So a patched base with any v1 segment is read into buffers. A v2 base's digests are taken in the
    worker before the write, and an unpatched base is never written.
    """
    return not patch or all(digests.is_tree_digest(seg.digest) for seg in base_segments)


def _check_views(reader: FileReader, seg: SourceSegment, new: Any, old: Any) -> None:
    """Raise if a chunk's mapped bytes met a file cut short while they were read (deltafs.buffers.cut_short: what
    is gone read as zeros, so the encoding and digests computed from them are wrong). The source is checked against
    its size too (nothing else would see zeros in the part of a last page past a cut); a base's bytes are checked
    against the digest its manifest records (_Lane._segment), which zeros do not match."""
    fd = getattr(reader, "fd", -1)
    if cut_short(new, fd):
        if os.fstat(fd).st_size >= (mapped_end(new) or 0):  # every byte is there: the fault was an I/O error
            raise SourceError(f"{getattr(reader, 'path', 'a source file')} could not be read while it was being "
                              f"pushed (at {seg.key[2:]}): an I/O error under a mapping")
        raise _shrank(reader, seg)
    if faulted(old):
        raise LocalBaseError("push cache file was cut short while it was read")


def _shrank(reader: FileReader, seg: SourceSegment) -> SourceError:
    where = getattr(reader, "path", "a source file")
    return SourceError(f"{where} shrank while it was being pushed (at {seg.key[2:]}): a checkpoint must not change "
                       "until its push returns")


_LOCAL_FS: dict[int, bool] = {}  # st_dev -> whether its files may be mapped (not a network filesystem)


def _mappable(fd: int, path: str) -> bool:
    """Whether to read fd's large chunks through mappings: a regular file on a local filesystem. A network
    filesystem's file may be cut short by another host without this one's page cache knowing (a SIGBUS through
    a mapping where a read would come back short), and its reads are bound by the network, not by a copy."""
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode):
        return False
    local = _LOCAL_FS.get(st.st_dev)
    if local is None:
        local = _LOCAL_FS[st.st_dev] = not is_network_fs(mount_fstype(path))
    return local


def patchable(files: list[SourceFile], base: LocalState) -> bool:
    """Whether the push cache can take these files by patching the base's own files in place.

    Each file must exist in the base under its path with the same size and the same segments at the same
    offsets (so every chunk's base is the chunk it replaces), be a plain file only the cache holds (one
    link: never a trainer's file that a hard link shares), and the base must hold no other file.
    """
    segs = base.manifest.segments()
    if {f.path for f in files} != {f.path for f in base.manifest.files}:
        return False
    for f in files:
        try:
            st = os.lstat(os.path.join(base.path, f.path))
        except OSError:
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_size != f.size:
            return False
        for seg in f.segments:
            hit = segs.get(seg.key)
            if hit is None or hit[0].path != f.path or hit[1].offset != seg.offset or hit[1].size != seg.size \
                    or hit[1].kind != seg.kind or hit[1].itemsize != seg.itemsize:
                return False
    return True


def discard(stage_dir: str | None) -> None:
    if stage_dir is not None:
        shutil.rmtree(stage_dir, ignore_errors=True)


__all__ = ["EncodeStats", "Encoder", "MAX_PUT_QUEUE", "discard", "may_map_bases", "patchable", "place_file"]
