"""Rebuild one version's files from a chain of manifests, verifying every digest on the way.

Shared by pull (writes a staging directory) and verify (hashes only). Work is per chunk: a
chunk's bytes at the target version come from the newest self-contained record in the chain
(raw), or from the local base, with the later delta records applied in order.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from typing import Callable, Generator, Iterator

import numpy as np
import xxhash

from deltafs import codec
from deltafs.errors import ChunkNotFoundError, DeltafsError, IntegrityError, ObjectNotFoundError
from deltafs.format.manifest import DELTA_CODECS, FileEntry, Manifest, Segment
from deltafs.read.dest import LocalState
from deltafs.parallel import default_threads, ordered_map
from deltafs.store.objects import LocalObjectStore
from deltafs.store.repo import Repository


class LocalBaseError(IntegrityError):
    """The local copy a delta would be applied to is missing or does not match its manifest."""


def _range_xxh3(path: str, offset: int, size: int, block: int = 8 << 20) -> str | None:
    """XXH3-128 of a byte range of a file, read in blocks (a tensor can be larger than memory allows)."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as fh:
        done = 0
        while done < size:
            data = os.pread(fh.fileno(), min(block, size - done), offset + done)
            if not data:
                return None  # truncated
            h.update(data)
            done += len(data)
    return "xxh3-128:" + h.hexdigest()


def file_sha256(path: str, block: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class Chain:
    """How to reach a target version: start from the local base (if any), then apply steps in order."""

    steps: list[Manifest]  # oldest first; the last one is the target (or its fold, see final)
    local: LocalState | None  # the base the first step applies to; None when the chain starts at a full version
    final: Manifest | None = None  # the target's own manifest when the last step is a fold (deltafs.read.folds)

    @property
    def target(self) -> Manifest:
        return self.final if self.final is not None else self.steps[-1]


def plan_chain(repo: Repository, target: int, local: LocalState | None, *, folds: bool = False) -> Chain:
    """Walk parents back from target until the local version or a full version; the cheaper path by bytes.

    Any full version on the way makes a chain that crosses it no cheaper than starting there, so
    stopping at the first full version or at the local base is the cheapest plan. With folds=True a
    chain that starts at a full version may be shortened to [full, fold of target] (deltafs.read.folds).
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
            if folds:
                from deltafs.read.folds import prefer_fold

                return prefer_fold(repo, Chain(steps, None))
            return Chain(steps, None)
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


class ChunkSource:
    """Fetches chunk objects, keeping verified copies in an optional local cache so a killed pull resumes."""

    def __init__(self, repo: Repository, cache_dir: str | None) -> None:
        self.repo = repo
        self.cache_dir = cache_dir
        self.bytes_read = 0
        self.cache_hits = 0
        self._lock = threading.Lock()

    def get(self, oid: str) -> bytes:
        if self.cache_dir:
            path = os.path.join(self.cache_dir, oid)
            try:
                with open(path, "rb") as fh:
                    data = fh.read()
                if hashlib.sha256(data).hexdigest() == oid:
                    with self._lock:
                        self.cache_hits += 1
                    return data
            except OSError:
                pass
        data = self.repo.get_chunk(oid)  # verifies the sha256
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
class BuildReport:
    files_built: int = 0
    files_linked: int = 0
    bytes_out: int = 0


class Builder:
    """Rebuilds the target of a chain into out_dir (or only hashes it when out_dir is None)."""

    def __init__(self, repo: Repository, chain: Chain, source: ChunkSource, *, threads: int | None = None,
                 on_bytes: Callable[[int], None] | None = None) -> None:
        self.repo = repo
        self.chain = chain
        self.source = source
        # Remote stores are latency-bound: keep many fetches in flight (decoding releases the GIL).
        self.threads = threads or (default_threads() if isinstance(repo.objects, LocalObjectStore) else 16)
        self.on_bytes = on_bytes or (lambda n: None)
        self.chunk_bytes = chain.target.chunk_bytes
        self._per_step = [m.segments() for m in chain.steps]
        self._local_segments = chain.local.manifest.segments() if chain.local else {}
        self._local_checked: dict[str, bool] = {}
        self._local_lock = threading.Lock()

    # --- local base ----------------------------------------------------------------------
    def _local_bytes(self, key: str, index: int, size: int) -> np.ndarray:
        local = self.chain.local
        if local is None or key not in self._local_segments:
            raise LocalBaseError(f"local base lacks {key[2:]}")
        fentry, seg = self._local_segments[key]
        path = os.path.join(local.path, fentry.path)
        self._check_local_segment(key, path, seg)
        start = seg.offset + index * self.chunk_bytes
        try:
            with open(path, "rb") as fh:
                data = os.pread(fh.fileno(), size, start)
        except OSError as exc:
            raise LocalBaseError(f"local base file {path} unreadable: {exc}") from None
        if len(data) != size:
            raise LocalBaseError(f"local base file {path} is truncated")
        return np.frombuffer(data, dtype=np.uint8)

    def _check_local_segment(self, key: str, path: str, seg: Segment) -> None:
        with self._local_lock:
            ok = self._local_checked.get(key)
            if ok is None:
                try:
                    ok = _range_xxh3(path, seg.offset, seg.size) == seg.digest
                except OSError:
                    ok = False
                self._local_checked[key] = ok
        if not ok:
            raise LocalBaseError(f"local base {path} does not match its manifest at {seg.key[2:]}")

    # --- one chunk ----------------------------------------------------------------------------
    def _chunk(self, task: _Task) -> np.ndarray:
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
        value: np.ndarray | None = self._local_bytes(key, i, size) if start_from_local else None
        if start_from_local and self.chain.local is None:
            raise IntegrityError(f"{key[2:]}: chunk {i} needs a base that the chain does not provide")
        for rec in records:
            payload = None
            if rec.object is not None:
                try:
                    payload = self.source.get(rec.object)
                except ObjectNotFoundError:
                    raise ChunkNotFoundError(f"chunk {rec.object} of {key[2:]} is missing") from None
            try:
                value = codec.decode(rec.codec, payload, value, size, task.seg.itemsize)
            except DeltafsError as exc:
                raise IntegrityError(f"{key[2:]}: chunk {i} ({rec.object}) cannot be decoded: {exc}") from None
        assert value is not None
        return value

    # --- files ----------------------------------------------------------------------------------
    def _tasks(self, files: list[FileEntry]) -> Iterator[_Task]:
        for f in files:
            for seg in f.segments:
                for i in range(len(seg.chunks)):
                    yield _Task(f, seg, i)

    def build(self, out_dir: str | None) -> BuildReport:
        """Write (or hash) every file of the target; raise IntegrityError on the first mismatch."""
        report = BuildReport()
        to_build = []
        for f in self.chain.target.files:
            if out_dir is not None and self._link_unchanged(f, out_dir):
                report.files_linked += 1
                self.on_bytes(f.size)
                continue
            to_build.append(f)
        results: Generator[tuple[_Task, np.ndarray], None, None] = ordered_map(
            lambda t: (t, self._chunk(t)), self._tasks(to_build), self.threads, self.threads * 2)
        # Empty files and empty segments have no chunks: walk files and segments explicitly.
        results_iter = iter(results)
        try:
            self._write_files(to_build, results_iter, out_dir, report)
        finally:
            results.close()  # stop the workers if a file failed its digest check
        return report

    def _write_files(self, to_build: list[FileEntry], results_iter: Iterator[tuple[_Task, np.ndarray]],
                     out_dir: str | None, report: BuildReport) -> None:
        for f in to_build:
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
                        raise IntegrityError(f"version {self.chain.target.version}: {f.path}: {_what(seg)} digest mismatch",
                                             expected=seg.digest, actual=got)
                if fh is not None:
                    fh.flush()
                    os.fsync(fh.fileno())
            finally:
                if fh is not None:
                    fh.close()
            if written != f.size or fhash.hexdigest() != f.sha256:
                raise IntegrityError(f"version {self.chain.target.version}: file {f.path} digest mismatch",
                                     expected=f.sha256, actual=fhash.hexdigest())
            report.files_built += 1
            report.bytes_out += written

    def _link_unchanged(self, f: FileEntry, out_dir: str) -> bool:
        """Reuse an identical local file (hard link, else copy) after re-hashing it."""
        local = self.chain.local
        if local is None:
            return False
        for lf in local.manifest.files:
            if lf.sha256 == f.sha256 and lf.size == f.size:
                src = os.path.join(local.path, lf.path)
                try:
                    if file_sha256(src) != f.sha256:
                        return False
                    dst = _mkparents(out_dir, f.path)
                    try:
                        os.link(src, dst)
                    except OSError:
                        import shutil

                        shutil.copyfile(src, dst)
                    return True
                except OSError:
                    return False
        return False


def _what(seg: Segment) -> str:
    if seg.kind == "tensor":
        return f"tensor {seg.key[2:]}"
    return "header" if seg.kind == "header" else "contents"


def _mkparents(out_dir: str | None, rel: str) -> str:
    assert out_dir is not None
    path = os.path.join(out_dir, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return path
