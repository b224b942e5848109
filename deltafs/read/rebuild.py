"""Rebuild one version's files from a chain of manifests, verifying every digest on the way.

Shared by pull (writes a staging directory) and verify (hashes only). Work is per chunk: a
chunk's bytes at the target version come from the newest self-contained record in the chain
(raw), or from the local base, with the later delta records applied in order.

A format v2 target is rebuilt with every chunk of every file in parallel: each worker decodes a
chunk, writes it at its offset into a preallocated file (pwrite) and hashes it; a segment is
checked when its last chunk lands, a file when its last segment does. Consecutive small chunks
(norms, biases) go to a worker together as a run, with one base read and one write. Memory is bounded by the
threads (a few chunks each). A v1 target's digests are serial streams, so it is written in order.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import hashlib
import os
import stat
import threading
import time
from dataclasses import dataclass, field
from collections.abc import Callable, Generator, Iterator

import numpy as np
import xxhash

from deltafs.buffers import aligned_empty, open_regular, pread_aligned
from deltafs import codec
from deltafs.errors import (ChunkNotFoundError, DeltafsError, DestinationError, FormatError, IntegrityError,
                            ObjectNotFoundError)
from deltafs.format import digests
from deltafs.format.manifest import DELTA_CODECS, ChunkRef, FileEntry, Segment
from deltafs.parallel import ordered_map
from deltafs.read.chain import Chain
from deltafs.read.dest import Placement, file_digest_on_disk, rewritable, segment_digest_on_disk
from deltafs.store.repo import Repository


# Chunks up to this size are rebuilt in runs (the encoder's runs: deltafs.publish.encode.SMALL_CHUNK, MAX_RUN).
RUN_CHUNK = 256 << 10
MAX_RUN = 64


class LocalBaseError(IntegrityError):
    """The local copy a delta would be applied to is missing or does not match its manifest."""


def _range_xxh3(path: str, offset: int, size: int, block: int = 8 << 20) -> str | None:
    """XXH3-128 of a byte range of a file, read in blocks (a tensor can be larger than memory allows)."""
    h = xxhash.xxh3_128()
    buf = aligned_empty(min(block, size))
    with open(path, "rb") as fh:
        done = 0
        while done < size:
            data = pread_aligned(fh.fileno(), min(block, size - done), offset + done, buf)
            if not data.size:
                return None  # truncated
            h.update(data.data)
            done += len(data)
    return "xxh3-128:" + h.hexdigest()


class ChunkSource:
    """Fetches chunk objects, keeping verified copies in an optional local cache so a killed pull resumes.

    No disk cache for a store on this machine: re-reading it costs what reading the cache would.
    Objects that several chunks share are kept in memory, up to MEMO_BYTES, so each is fetched once: packs
    (format 3: the payloads of a run of small chunks in one object), and small objects several records name (a
    run of identical chunks). The least recently used leave first when the memo is full; a build takes a pack's
    chunks one after another, so the pack in use stays.
    """

    MEMO_OBJECT_BYTES = 64 << 10
    MEMO_BYTES = 64 << 20

    def __init__(self, repo: Repository, cache_dir: str | None, *, memo_unshared: bool = True) -> None:
        self.repo = repo
        self.memo_unshared = memo_unshared
        self.cache_dir = cache_dir if repo.objects.local_root is None else None
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._memo: dict[str, bytes] = {}  # the least recently used first
        self._memo_bytes = 0
        self._inflight: dict[str, threading.Event] = {}
        # Objects that could not be fetched (missing, or still damaged after the retries): the other chunks of a
        # pack fail at once with the same error instead of each fetching it again.
        self._failed: dict[str, IntegrityError | ChunkNotFoundError] = {}

    def get(self, rec: ChunkRef, shared: bool = True) -> bytes:
        """The chunk's payload; shared=False: no other chunk of this build needs its object, so unless memo_unshared
        (a source that several builds reuse: verify, inspect) it skips the memo and the in-flight entry."""
        oid = rec.object
        assert oid is not None
        size = rec.object_bytes
        keep = rec.pack is not None or ((shared or self.memo_unshared) and size <= self.MEMO_OBJECT_BYTES)
        while keep:
            with self._lock:
                memo = self._memo.get(oid)
                if memo is not None:
                    if len(memo) != size:  # this record's claim, as a fetch checks it: verify and pull must agree
                        raise IntegrityError(f"chunk {oid} in {self.repo.url} is {len(memo)} bytes, manifest says "
                                             f"{size}")
                    self._memo[oid] = self._memo.pop(oid)  # now the newest: eviction takes the least recently used
                    return rec.payload_of(memo)
                failed = self._failed.get(oid)
                if failed is not None:
                    raise copy.copy(failed)  # one instance per raise: threads do not share a traceback
                waiting = self._inflight.get(oid)
                if waiting is None:
                    self._inflight[oid] = threading.Event()  # this thread fetches it; others wait
                    break
            waiting.wait()
        try:
            try:
                data = self._fetch(oid, size)
            except (IntegrityError, ChunkNotFoundError) as exc:
                # Damaged after every retry, or missing: final for this source. Store errors (a dropped connection)
                # are not remembered: the next chunk, or the next call of a reused source, tries again.
                if keep:
                    with self._lock:
                        self._failed[oid] = copy.copy(exc)  # without this thread's traceback and its frames
                raise
            if keep and size <= self.MEMO_BYTES:
                with self._lock:
                    while self._memo and self._memo_bytes + size > self.MEMO_BYTES:
                        self._memo_bytes -= len(self._memo.pop(next(iter(self._memo))))
                    self._memo[oid] = data
                    self._memo_bytes += size
            return rec.payload_of(data)
        finally:
            if keep:
                with self._lock:
                    event = self._inflight.pop(oid, None)
                if event is not None:
                    event.set()

    def _fetch(self, oid: str, size: int) -> bytes:
        if self.cache_dir:
            path = os.path.join(self.cache_dir, oid)
            try:
                with open(path, "rb") as fh:
                    data = fh.read(size + 1)
                if len(data) == size and hashlib.sha256(data).hexdigest() == oid:
                    return data
            except OSError:
                pass
        data = self.repo.get_chunk(oid, size)  # verifies size and sha256, refetching a damaged one
        with self._lock:
            self.bytes_read += len(data)
        if self.cache_dir:
            os.makedirs(self.cache_dir, exist_ok=True)
            tmp = os.path.join(self.cache_dir, f".tmp-{oid}-{threading.get_ident()}")
            with open(tmp, "wb") as fh:
                fh.write(data)
            os.replace(tmp, os.path.join(self.cache_dir, oid))
        return data


@dataclass
class _Task:
    file: FileEntry
    seg: Segment
    index: int


@dataclass
class _FileOut:
    """A file being rebuilt: chunk digests land here from any thread; complete when `left` reaches 0."""

    entry: FileEntry
    path: str | None  # where it is written (None: only hashed)
    ident: tuple[int, ...] | None  # _identity() of the file made for it: reopened, it must be the same one
    left: int
    fd: int | None = None  # open only while its chunks are written: a version of 100,000 files must not need as many
    chunk_digests: dict[str, list[bytes | None]] = field(default_factory=dict)
    seg_left: dict[str, int] = field(default_factory=dict)


class Builder:
    """Rebuilds the target of a chain into out_dir (or only hashes it when out_dir is None)."""

    def __init__(self, repo: Repository, chain: Chain, source: ChunkSource, *, threads: int | None = None,
                 on_bytes: Callable[[int], None] | None = None) -> None:
        self.repo = repo
        self.chain = chain
        self.source = source
        # Remote stores are latency-bound (capabilities.concurrency fetches in flight), local work is
        # CPU-bound: decoding, hashing and writing release the GIL, so one thread per core at least.
        self.threads = threads or max(repo.objects.capabilities.concurrency, os.cpu_count() or 1)
        self.on_bytes = on_bytes or (lambda n: None)
        self.chunk_bytes = chain.target.chunk_bytes
        self._per_step = [m.segments() for m in chain.steps]
        self._local_segments = chain.local.manifest.segments() if chain.local else {}
        # DEST's files by (digest, size), for _link_unchanged: a scan of all of them per file was quadratic (a full
        # version of 10,000 small files: 8.5 s against 3.3 s), which pulls that start at a full version pay too.
        self._link_from = chain.local or chain.link
        self._local_files: dict[tuple[str, int], list[FileEntry]] = {}
        for lf in self._link_from.manifest.files if self._link_from is not None else ():
            self._local_files.setdefault((lf.digest, lf.size), []).append(lf)
        self._placement = Placement(self._link_from.path) if self._link_from is not None else None
        # Only a source that memoizes shared objects alone asks which they are (a pass over every chunk record).
        self._shared = None if source.memo_unshared else _shared_objects(chain)
        self._local_checked: dict[str, bool] = {}
        self._local_lock = threading.Lock()
        self._local_fds: dict[str, int] = {}

    # --- local base ----------------------------------------------------------------------
    def _local_fd(self, path: str) -> int:
        with self._local_lock:
            fd = self._local_fds.get(path)
            if fd is None:
                try:
                    fd = open_regular(path)
                except OSError as exc:
                    raise LocalBaseError(f"local base file {path} unreadable: {exc}") from None
                self._local_fds[path] = fd
            return fd

    def _local_bytes(self, key: str, index: int, size: int, check: bool, out: np.ndarray | None) -> np.ndarray:
        """Chunk `index` of the local base's segment `key`, read into out (a reused buffer) when given."""
        local = self.chain.local
        if local is None or key not in self._local_segments:
            raise LocalBaseError(f"local base lacks {key[2:]}")
        fentry, seg = self._local_segments[key]
        path = os.path.join(local.path, fentry.path)
        if check:
            self._check_local_segment(key, path, seg)
        offset = seg.offset + index * self.chunk_bytes
        try:
            if out is None:
                data = np.frombuffer(os.pread(self._local_fd(path), size, offset), dtype=np.uint8)
                got = data.size
            else:
                # Into a buffer the worker reuses: a fresh 4 MiB object per read costs more in page faults
                # than the read itself.
                data = pread_aligned(self._local_fd(path), size, offset, out)
                got = data.size
        except OSError as exc:
            raise LocalBaseError(f"local base file {path} unreadable: {exc}") from None
        if got != size:
            raise LocalBaseError(f"local base file {path} is truncated")
        return data

    def _check_local_segment(self, key: str, path: str, seg: Segment) -> None:
        with self._local_lock:
            ok = self._local_checked.get(key)
        if ok is None:
            try:
                ok = _range_digest(path, seg, self.chain.local.manifest.chunk_bytes) == seg.digest  # type: ignore[union-attr]
            except OSError:
                ok = False
            with self._local_lock:
                self._local_checked[key] = ok
        if not ok:
            raise LocalBaseError(f"local base {path} does not match its manifest at {seg.key[2:]}")

    def _blame_local(self, key: str) -> None:
        """After a segment came out wrong: raise LocalBaseError if the local base it was built on is damaged."""
        local = self.chain.local
        if local is not None and key in self._local_segments:
            fentry, seg = self._local_segments[key]
            self._check_local_segment(key, os.path.join(local.path, fentry.path), seg)

    def _close_local(self) -> None:
        with self._local_lock:
            for fd in self._local_fds.values():
                os.close(fd)
            self._local_fds.clear()

    # --- one chunk ----------------------------------------------------------------------------
    def _chunk(self, task: _Task, check_base: bool = True, out: np.ndarray | None = None,
               base_in_out: bool = False) -> np.ndarray:
        """The chunk's bytes at the target version, decoded into out (size bytes, reused) when given.

        base_in_out: out holds the chunk's local base already (read with its run, see _read_local_run)."""
        key, i = task.seg.key, task.index
        size = task.seg.chunks[i].size
        records = []
        start_from_local = True
        for step in reversed(self._per_step):
            entry = step.get(key)
            if entry is None or len(entry[1].chunks) <= i or entry[1].chunks[i].size != size:
                raise IntegrityError(f"{key[2:]}: chunk {i} has no consistent history in the chain")
            rec = entry[1].chunks[i]
            records.append(rec)
            if rec.name not in DELTA_CODECS:
                start_from_local = False
                break
        records.reverse()
        if start_from_local and self.chain.local is None:
            raise IntegrityError(f"{key[2:]}: chunk {i} needs a base that the chain does not provide")
        if out is not None:
            out = out[:size]
        value: np.ndarray | None = None
        if start_from_local:
            value = out if base_in_out and out is not None else self._local_bytes(key, i, size, check_base, out)
        for rec in records:
            payload = None
            if rec.object is not None:
                try:
                    payload = self.source.get(rec, self._shared is None or rec.object in self._shared)
                except ObjectNotFoundError:
                    raise ChunkNotFoundError(f"{self._at(task.file.path, task.seg)}, chunk {i}: object {rec.object} is missing "
                                             f"from {self.repo.url}") from None
                except IntegrityError as exc:  # say where it belongs: the store's error knows only the object
                    raise IntegrityError(f"{self._at(task.file.path, task.seg)}, chunk {i}: {exc.what}", expected=exc.expected,
                                         actual=exc.actual) from None
            try:
                # In place: every codec checks its payload before it writes to out (= the base here).
                value = codec.decode(rec.codec, payload, value, size, task.seg.itemsize, out=out)
            except FormatError as exc:  # the record itself (an unknown codec, a field out of range): the manifest's fault
                raise FormatError(f"{self._at(task.file.path, task.seg)}, chunk {i}: bad codec record: {exc}") from None
            except DeltafsError as exc:
                raise IntegrityError(f"{key[2:]}: chunk {i} ({rec.object}) cannot be decoded: {exc}") from None
        assert value is not None
        return value

    def segment_chunks(self, f: FileEntry, seg: Segment, into: np.ndarray | None = None) -> Iterator[np.ndarray]:
        """One segment of the target chunk by chunk, each a view of one reused buffer (valid until the next), and
        after the last a check against the segment's digest (IntegrityError): the memory of one chunk, not of the
        segment (a 2 GiB embedding compared by `diff` held two copies of both versions). A caller must use what
        the chunks say only once the iteration ended without an error.

        into: a uint8 array of the segment's size to decode the chunks into, each at its place (segment_bytes)."""
        buf = np.empty(min(self.chunk_bytes, seg.size), np.uint8) if into is None else into
        v1 = not digests.is_tree_digest(seg.digest)
        stream = xxhash.xxh3_128() if v1 else None
        chunk_digests: list[bytes] = []
        try:
            for i, rec in enumerate(seg.chunks):
                # Decoded into this slice (codec.decode's out contract); the digest below checks it.
                at = 0 if into is None else i * self.chunk_bytes
                out = buf[at:at + rec.size]
                self._chunk(_Task(f, seg, i), out=out)
                if stream is not None:
                    stream.update(out.data)
                else:
                    chunk_digests.append(digests.chunk_digest(out.data))
                yield out
        finally:
            self._close_local()
        actual = (digests.V1_SEGMENT_PREFIX + stream.hexdigest() if stream is not None
                  else digests.segment_digest(chunk_digests, seg.size))
        if actual != seg.digest:
            raise IntegrityError(f"{self._at(f.path, seg)} digest mismatch",
                                 expected=seg.digest, actual=actual)

    def segment_bytes(self, f: FileEntry, seg: Segment) -> bytes:
        """One segment of the target, rebuilt chunk by chunk and checked against its digest (IntegrityError)."""
        out = bytearray(seg.size)
        for _ in self.segment_chunks(f, seg, into=np.frombuffer(out, dtype=np.uint8)):
            pass
        return bytes(out)

    # --- files ----------------------------------------------------------------------------------
    def _tasks(self, files: list[FileEntry]) -> Iterator[_Task]:
        for f in files:
            for seg in f.segments:
                for i in range(len(seg.chunks)):
                    yield _Task(f, seg, i)

    def _runs(self, files: list[FileEntry]) -> Iterator[list[_Task]]:
        """The tasks in file order, cut into runs: a large chunk alone; consecutive small ones of one file that
        tile one byte range together, up to chunk_bytes or MAX_RUN of them (as the encoder packs them), so a
        model of thousands of small tensors pays one task, one base read and one write per run, not per tensor."""
        run: list[_Task] = []
        run_bytes = end = 0
        for task in self._tasks(files):
            size = task.seg.chunks[task.index].size
            start = task.seg.offset + task.index * self.chunk_bytes
            if run and (size > RUN_CHUNK or task.file is not run[0].file or start != end
                        or run_bytes + size > self.chunk_bytes or len(run) >= MAX_RUN):
                yield run
                run, run_bytes = [], 0
            run.append(task)
            run_bytes, end = run_bytes + size, start + size
            if size > RUN_CHUNK:
                yield run
                run, run_bytes = [], 0
        if run:
            yield run

    def _run_bytes(self, run: list[_Task], buf: np.ndarray) -> list[int]:
        """Every chunk of a run rebuilt into consecutive slices of buf (one base read where the base allows); their
        sizes. codec.decode decodes into the slice it is given, so buf holds the run's bytes after this."""
        sizes = [t.seg.chunks[t.index].size for t in run]
        based = self._read_local_run(run, sizes, buf)
        pos = 0
        for task, size in zip(run, sizes, strict=True):
            self._chunk(task, check_base=False, out=buf[pos:pos + size], base_in_out=based)
            pos += size
        return sizes

    def _read_local_run(self, run: list[_Task], sizes: list[int], buf: np.ndarray) -> bool:
        """Read the local base of every chunk of the run into buf in one pread, if it holds them in one range of
        one file in the same order (the usual case: same layout); False (nothing read) otherwise."""
        local = self.chain.local
        if local is None or len(run) < 2:
            return False
        first = self._local_segments.get(run[0].seg.key)
        if first is None:
            return False
        start = first[1].offset + run[0].index * self.chunk_bytes
        at = start
        for task, size in zip(run, sizes, strict=True):
            hit = self._local_segments.get(task.seg.key)
            if hit is None or hit[0].path != first[0].path or hit[1].offset + task.index * self.chunk_bytes != at:
                return False
            at += size
        path = os.path.join(local.path, first[0].path)
        try:
            got = pread_aligned(self._local_fd(path), at - start, start, buf).size
        except OSError as exc:
            raise LocalBaseError(f"local base file {path} unreadable: {exc}") from None
        if got != at - start:
            raise LocalBaseError(f"local base file {path} is truncated")
        return True

    def build(self, out_dir: str | None) -> None:
        """Write (or hash) every file of the target; raise IntegrityError on the first mismatch."""
        to_build = []
        for f in self.chain.target.files:
            if out_dir is not None and self._link_unchanged(f, out_dir):
                self.on_bytes(f.size)
                continue
            to_build.append(f)
        try:
            if self.chain.target.format_version >= 2:
                self._build_parallel(to_build, out_dir)
            else:
                self._build_in_order(to_build, out_dir)
        finally:
            self._close_local()

    # v2: every chunk of every file in parallel, written at its offset, verified by its chunk digest.
    def _build_parallel(self, to_build: list[FileEntry], out_dir: str | None) -> None:
        if out_dir is not None:
            _check_space(out_dir, sum(f.size - _reusable_bytes(out_dir, f) for f in to_build))
        outs = [self._open_out(f, out_dir) for f in to_build]
        by_path = {o.entry.path: o for o in outs}
        lock = threading.Lock()
        runs = self._runs(to_build)
        failure: list[BaseException] = []

        def worker() -> None:
            try:
                buf = aligned_empty(self.chunk_bytes)  # this worker's chunk, reused for every task (deltafs.buffers)
            except BaseException as exc:  # (MemoryError: a chunk size this host cannot hold) fails the build
                with lock:
                    failure.append(exc)
                return
            while True:
                with lock:
                    if failure:
                        return
                    run = next(runs, None)
                if run is None:
                    return
                try:
                    # The output digest covers the base: a damaged base shows as a segment mismatch
                    # and is only then looked at (_blame_local), not hashed up front.
                    sizes = self._run_bytes(run, buf)
                    # Written and hashed from the same memory: the run's chunks, one after another in buf.
                    total = sum(sizes)
                    out = by_path[run[0].file.path]
                    if out.path is not None:
                        with lock:  # opened by the first run that writes it, closed by _finish_file
                            fd = out.fd = out.fd if out.fd is not None else _reopen(out)
                        pwrite_all(fd, buf[:total].data, run[0].seg.offset + run[0].index * self.chunk_bytes)
                    digest_list = [digests.chunk_digest(v) for v in _slices(buf, sizes)]
                    self.on_bytes(total)
                    done: list[Segment] = []
                    with lock:
                        for task, digest in zip(run, digest_list, strict=True):
                            out.chunk_digests[task.seg.key][task.index] = digest
                            out.seg_left[task.seg.key] -= 1
                            if out.seg_left[task.seg.key] == 0:
                                done.append(task.seg)
                        out.left -= len(run)
                        file_done = out.left == 0
                    for seg in done:
                        self._check_segment(out, seg)
                    if file_done:
                        self._finish_file(out)
                except BaseException as exc:
                    with lock:
                        failure.append(exc)
                    return

        workers: list[threading.Thread] = []
        try:
            for out in outs:  # files and segments without chunks are complete already
                for seg in out.entry.segments:
                    if not seg.chunks:
                        self._check_segment(out, seg)
                if out.left == 0:
                    self._finish_file(out)
            workers = [threading.Thread(target=worker, name=f"deltafs-pull-{n}", daemon=True)
                       for n in range(max(1, self.threads))]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            if failure:
                raise failure[0]
            unfinished = [o.entry.path for o in outs if o.left]
            if unfinished:  # never install what no worker wrote: a worker that stopped without a failure is a bug
                raise IntegrityError(f"{unfinished[0]} was not rebuilt completely ({len(unfinished)} file(s)); nothing "
                                     "was installed")
        finally:
            # Interrupted (Ctrl-C, SIGTERM) while the workers run: stop them and wait before closing their files, or a
            # worker could write a chunk through a descriptor number the cleanup has been given for another file.
            with lock:
                failure.append(KeyboardInterrupt())
            if _join_all(workers):
                for out in outs:
                    if out.fd is not None:
                        os.close(out.fd)
                        out.fd = None
            # else: a worker still waits on the store (up to its request timeout): its files stay open until the
            # process ends, never closed under it.

    def _open_out(self, f: FileEntry, out_dir: str | None) -> _FileOut:
        """The file made at its size (every byte below it is written next: segments tile the file), and closed."""
        path = ident = None
        if out_dir is not None:
            path = _mkparents(out_dir, f.path)
            fd = _open_for_rewrite(path)
            try:
                os.ftruncate(fd, f.size)
                st = os.fstat(fd)
            finally:
                os.close(fd)
            ident = _identity(st)
        out = _FileOut(f, path, ident, sum(len(s.chunks) for s in f.segments))
        for seg in f.segments:
            out.chunk_digests[seg.key] = [None] * len(seg.chunks)
            out.seg_left[seg.key] = len(seg.chunks)
        return out

    def _at(self, path: str, seg: Segment) -> str:
        """Where an error is: "version N: FILE: tensor NAME" (or its header, or contents)."""
        return f"version {self.chain.target.version}: {path}: {_what(seg)}"

    def _check_segment(self, out: _FileOut, seg: Segment) -> None:
        got = digests.segment_digest(out.chunk_digests[seg.key], seg.size)  # type: ignore[arg-type]
        if got != seg.digest:
            self._blame_local(seg.key)
            raise IntegrityError(f"{self._at(out.entry.path, seg)} digest mismatch",
                                 expected=seg.digest, actual=got)

    def _finish_file(self, out: _FileOut) -> None:
        f = out.entry
        got = digests.file_digest([s.digest for s in f.segments], f.size)  # each segment already checked
        if got != f.digest:
            raise IntegrityError(f"version {self.chain.target.version}: file {f.path} digest mismatch",
                                 expected=f.digest, actual=got)
        if out.path is not None:
            fd, out.fd = (out.fd if out.fd is not None else _reopen(out)), None
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    # v1: segment and file digests are streams over the bytes, so chunks are hashed in file order.
    def _build_in_order(self, to_build: list[FileEntry], out_dir: str | None) -> None:
        results: Generator[tuple[_Task, np.ndarray], None, None] = ordered_map(
            lambda t: (t, self._chunk(t)), self._tasks(to_build), self.threads, self.threads * 2)
        results_iter = iter(results)
        try:
            for f in to_build:
                self._write_v1_file(f, results_iter, out_dir)
        finally:
            results.close()  # stop the workers if a file failed its digest check

    def _write_v1_file(self, f: FileEntry, results_iter: Iterator[tuple[_Task, np.ndarray]], out_dir: str | None) -> None:
        fh = open(os.path.join(_mkparents(out_dir, f.path)), "wb") if out_dir is not None else None
        fhash = hashlib.sha256()
        written = 0
        try:
            for seg in f.segments:
                shash = xxhash.xxh3_128()
                for _ in seg.chunks:
                    task, data = next(results_iter)
                    assert task.seg is seg
                    view = data.data  # a memoryview: hashing and writing without copies
                    shash.update(view)
                    fhash.update(view)
                    if fh is not None:
                        fh.write(view)
                    written += data.size
                    self.on_bytes(data.size)
                got = "xxh3-128:" + shash.hexdigest()
                if got != seg.digest:
                    raise IntegrityError(f"{self._at(f.path, seg)} digest mismatch",
                                         expected=seg.digest, actual=got)
            if fh is not None:
                fh.flush()
                os.fsync(fh.fileno())
        finally:
            if fh is not None:
                fh.close()
        actual = "sha256:" + fhash.hexdigest()
        if written != f.size or actual != f.digest:
            raise IntegrityError(f"version {self.chain.target.version}: file {f.path} digest mismatch",
                                 expected=f.digest, actual=actual)

    def _link_unchanged(self, f: FileEntry, out_dir: str) -> bool:
        """Reuse an identical local file (hard link, else copy) after re-hashing it."""
        local, placement = self._link_from, self._placement
        if local is None or placement is None:
            return False
        for lf in self._local_files.get((f.digest, f.size), ()):
            src = os.path.join(local.path, lf.path)
            try:
                # Only a regular file reached without a symlink below DEST's version: link(2) does not follow a
                # symlink, so a link planted in DEST (to a file outside it with the right bytes) became part of the
                # new version, "repaired" at every pull; through a symlinked directory the outside file itself did.
                before = os.lstat(src)
                if not stat.S_ISREG(before.st_mode) or not placement.parent_in_place(lf.path) \
                        or file_digest_on_disk(src, f, self.chunk_bytes) != f.digest:
                    continue
                after = os.lstat(src)
                if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino) or not stat.S_ISREG(after.st_mode):
                    continue
                dst = _mkparents(out_dir, f.path)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(dst)  # a file of a recycled version (DEST.recycle_as_staging)
                try:
                    os.link(src, dst)
                except OSError:
                    import shutil

                    shutil.copyfile(src, dst)
                    return True  # a copy of the bytes just hashed through the same checked path
                linked = os.lstat(dst)
                if (linked.st_dev, linked.st_ino) != (before.st_dev, before.st_ino):
                    os.unlink(dst)  # a directory of src swapped for a link between the checks and link(2)
                    continue
                return True
            except OSError:
                continue
        return False


def _shared_objects(chain: Chain) -> set[str]:
    """Objects that more than one chunk record of the chain names (a run of identical chunks, a chunk that did
    not change between two steps): only these are worth the source's memo and its in-flight bookkeeping, which
    cost more than a local read of a small object (~12 us against ~17 us)."""
    seen: set[str] = set()
    shared: set[str] = set()
    for man in chain.steps:
        for f in man.files:
            for seg in f.segments:
                for rec in seg.chunks:
                    oid = rec.object
                    if oid is not None:
                        if oid in seen:
                            shared.add(oid)
                        else:
                            seen.add(oid)
    return shared


def _range_digest(path: str, seg: Segment, chunk_bytes: int) -> str | None:
    """A segment's digest computed from a file on disk, in the scheme of seg.digest."""
    if not digests.is_tree_digest(seg.digest):
        return _range_xxh3(path, seg.offset, seg.size)
    return segment_digest_on_disk(path, seg, chunk_bytes)


def _slices(buf: np.ndarray, sizes: list[int]) -> list[memoryview]:
    """Consecutive pieces of buf of these sizes, from its start."""
    views, pos = [], 0
    for size in sizes:
        views.append(buf[pos:pos + size].data)
        pos += size
    return views


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Write all of view at offset (pwrite may write less than asked)."""
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _join_all(threads: list[threading.Thread], wait: float = 5.0) -> bool:
    """Wait up to `wait` seconds for every thread (a second interrupt included: each stops at its next task, a chunk
    of milliseconds, unless it waits on the store); whether all ended."""
    deadline = time.monotonic() + wait
    for t in threads:
        while t.is_alive() and time.monotonic() < deadline:
            try:
                t.join(max(0.0, deadline - time.monotonic()))
            except KeyboardInterrupt:
                continue
    return not any(t.is_alive() for t in threads)


def _identity(st: os.stat_result) -> tuple[int, ...]:
    """A file's identity until something changes it: its inode, and its ctime, since a file made in place of a removed
    one can be given the freed inode number."""
    return st.st_dev, st.st_ino, st.st_ctime_ns


def _reopen(out: _FileOut) -> int:
    """The file _open_out made for `out`, open for writing: never through a link, and never another file put in its
    place since (the staging directory is ours, but a planted name must fail the build, not receive its bytes)."""
    assert out.path is not None
    fd = os.open(out.path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    if _identity(os.fstat(fd)) != out.ident:
        os.close(fd)
        raise DestinationError(f"{out.path} was replaced while version files were written into it; nothing was "
                               "installed")
    return fd


def _open_for_rewrite(path: str) -> int:
    """A file to write a version's bytes into: the regular, single-link file already at path (a recycled
    version's: its pages are reused, not allocated again), else a new one. Never through a symlink."""
    flags = os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
            raise  # the process's or the host's limits, not the file's: replacing it would not help
        # a link (ELOOP), a file made read-only, a directory: replaced below
    else:
        if rewritable(os.fstat(fd)):
            return fd
        os.close(fd)
    os.unlink(path)  # a link, or a file another name shares: writing into it would change that one too
    return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)


def _reusable_bytes(out_dir: str, f: FileEntry) -> int:
    """Bytes of f that a file already in out_dir (a recycled version's) holds allocated."""
    try:
        st = os.lstat(os.path.join(out_dir, f.path))
    except OSError:
        return 0
    return min(st.st_size, f.size) if rewritable(st) else 0


def _check_space(out_dir: str, need: int) -> None:
    """Fail before any work when the filesystem of out_dir has less free space than the files to write.

    Not posix_fallocate per file: on tmpfs that allocates and zeroes every page up front on one thread (0.4 s per
    GiB on the benchmark VM) and the workers' writes then touch each page again; the workers allocate as they
    write instead. A disk that fills meanwhile still fails the write with ENOSPC.
    """
    if need <= 0:
        return
    st = os.statvfs(out_dir)
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({need} bytes to write, {free} free)", out_dir)


def _what(seg: Segment) -> str:
    if seg.kind == "tensor":
        return f"tensor {seg.key[2:]}"
    return "header" if seg.kind == "header" else "contents"


def _mkparents(out_dir: str | None, rel: str) -> str:
    assert out_dir is not None
    path = os.path.join(out_dir, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return path
