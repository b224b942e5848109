"""A small typed object-store layer over fsspec: get, put, put_if_absent, list, delete.

fsspec stays inside this package. Correctness never rests on fsspec transactions: objects are
immutable and content-addressed, and a version commits through one create-if-absent write.

Every call goes through one retry loop: transient failures (timeouts, dropped connections,
throttling, 5xx) are retried with exponential backoff and full jitter, a bounded number of times;
permanent ones (missing key, access denied, missing bucket) become a deltafs error at once.
"""

from __future__ import annotations

import asyncio
import enum
import errno
import os
import random
import threading
import time
import uuid
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable, TypeVar

from deltafs.errors import DeltafsError, ObjectNotFoundError, StoreError, StoreNotFoundError

T = TypeVar("T")


@dataclass(frozen=True)
class Capabilities:
    """What a backend guarantees; FORMAT.md's per-backend table is written from these."""

    atomic_put: bool  # a reader never sees a partially written object
    atomic_create: bool  # put_if_absent cannot let two writers both win
    durable: bool  # a successful put has been flushed to stable storage
    # A completed put is visible at once to get/exists/list from every client. When False,
    # reads of keys that something else references (get(..., referenced=True)) wait for them.
    read_after_write: bool = True


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try before giving up; the defaults suit a flaky network, not a dead one."""

    attempts: int = 5  # total tries of one call on transient errors
    base_delay: float = 0.2  # seconds; doubled each retry
    max_delay: float = 5.0
    visibility_timeout: float = 10.0  # how long a referenced key may take to appear

    def delay(self, attempt: int) -> float:
        # Full jitter (AWS architecture blog): spreads a fleet of pullers that failed together.
        return random.uniform(0.0, min(self.max_delay, self.base_delay * (2**attempt)))


class _Kind(enum.Enum):
    NOT_FOUND = "not found"
    NO_BUCKET = "no bucket"
    DENIED = "denied"
    EXISTS = "exists"
    TRANSIENT = "transient"
    FATAL = "fatal"


# Exception classes from backend libraries that mean "the network hiccuped, try again".
# Matched by name so this module imports none of them.
_TRANSIENT_NAMES = {
    "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
    "HTTPClientError", "ResponseParserError", "IncompleteRead", "ProtocolError", "FSTimeoutError",
    "ClientPayloadError", "ClientConnectionError", "ClientOSError", "ServerDisconnectedError",
    "ServerTimeoutError", "ClientConnectorError", "TransportError", "RetryError",
}
_TRANSIENT_ERRNOS = {
    errno.EBUSY, errno.EIO, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
    errno.ECONNABORTED, errno.EPIPE, errno.ESTALE, errno.ENETUNREACH, errno.EHOSTUNREACH,
    getattr(errno, "EREMOTEIO", errno.EIO),
}
_BACKEND_MODULES = ("botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "google", "fsspec", "s3fs", "gcsfs")


def classify(exc: BaseException) -> _Kind | None:
    """What kind of failure exc is; None for exceptions that are not storage errors (bugs)."""
    if isinstance(exc, DeltafsError):
        return None
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & {"NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError"}:
        return _Kind.DENIED
    if names & _TRANSIENT_NAMES or isinstance(exc, (TimeoutError, ConnectionError, asyncio.TimeoutError)):
        return _Kind.TRANSIENT
    if isinstance(exc, FileExistsError):
        return _Kind.EXISTS
    if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return _Kind.NOT_FOUND
    if isinstance(exc, PermissionError):
        return _Kind.DENIED
    if isinstance(exc, OSError):
        return _Kind.TRANSIENT if exc.errno in _TRANSIENT_ERRNOS else _Kind.FATAL
    if type(exc).__module__.split(".")[0] in _BACKEND_MODULES:
        return _Kind.FATAL
    return None


class ObjectStore:
    """Bytes under string keys below one root URL."""

    capabilities = Capabilities(atomic_put=False, atomic_create=False, durable=False)

    def __init__(self, fs: Any, root: str, url: str, *, retry: RetryPolicy | None = None,
                 max_workers: int = 16) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        self.retry = retry or RetryPolicy()
        self.max_workers = max(1, max_workers)
        # Per instance, so a store can be declared weaker than its class (storage options, NFS).
        self.capabilities = type(self).capabilities

    def declare(self, **flags: bool) -> None:
        """Override capability flags, e.g. for an S3-compatible server that ignores If-None-Match."""
        self.capabilities = replace(self.capabilities, **flags)

    def path(self, key: str) -> str:
        return f"{self.root}/{key}" if self.root else key

    # --- error handling -------------------------------------------------------------------
    def _kind(self, exc: BaseException) -> _Kind | None:
        """Backends refine this (e.g. S3 tells a missing bucket from a missing key)."""
        return classify(exc)

    def _denied_hint(self) -> str:
        return "check credentials"

    def _error(self, kind: _Kind, exc: BaseException, action: str, key: str, attempts: int) -> DeltafsError:
        if kind is _Kind.NOT_FOUND:
            return ObjectNotFoundError(f"{key} not found in {self.url}")
        if kind is _Kind.NO_BUCKET:
            return StoreNotFoundError(f"bucket of {self.url} does not exist: create it or fix the URL")
        if kind is _Kind.DENIED:
            return StoreError(f"access denied to {self.url}: {self._denied_hint()} ({_one_line(exc)})")
        if kind is _Kind.TRANSIENT:
            return StoreError(f"cannot {action} {key} at {self.url} after {attempts} attempts: {_one_line(exc)}")
        return StoreError(f"cannot {action} {key} at {self.url}: {_one_line(exc)}")

    def _decide(self, exc: BaseException, attempt: int, waited_since: float | None,
                referenced: bool) -> tuple[float | None, float | None]:
        """(seconds to sleep before retrying, or None to give up; new waited_since)."""
        kind = self._kind(exc)
        if kind is _Kind.TRANSIENT and attempt + 1 < self.retry.attempts:
            return self.retry.delay(attempt), waited_since
        if kind is _Kind.NOT_FOUND and referenced and not self.capabilities.read_after_write:
            started = waited_since if waited_since is not None else time.monotonic()
            if time.monotonic() - started < self.retry.visibility_timeout:
                return min(self.retry.max_delay, self.retry.base_delay * 2 ** min(attempt, 5)), started
        return None, waited_since

    def _call(self, action: str, key: str, fn: Callable[[], T], *, referenced: bool = False) -> T:
        """Run fn with the retry policy; storage failures come out as deltafs errors."""
        attempt, since = 0, None
        while True:
            try:
                return fn()
            except Exception as exc:
                kind = self._kind(exc)
                if kind is None:
                    raise
                pause, since = self._decide(exc, attempt, since, referenced)
                if pause is None:
                    raise self._error(kind, exc, action, key, attempt + 1) from exc
                time.sleep(pause)
                attempt += 1

    async def _acall(self, action: str, key: str, fn: Callable[[], Awaitable[T]], *,
                     referenced: bool = False) -> T:
        attempt, since = 0, None
        while True:
            try:
                return await fn()
            except Exception as exc:
                kind = self._kind(exc)
                if kind is None:
                    raise
                pause, since = self._decide(exc, attempt, since, referenced)
                if pause is None:
                    raise self._error(kind, exc, action, key, attempt + 1) from exc
                await asyncio.sleep(pause)
                attempt += 1

    # --- single objects ---------------------------------------------------------------------
    def _read(self, key: str) -> bytes:
        return bytes(self.fs.cat_file(self.path(key)))

    def get(self, key: str, *, referenced: bool = False) -> bytes:
        """The object's bytes.

        referenced=True says something committed names this key (HEAD → manifest, manifest →
        chunk), so on a backend without read-after-write visibility a miss is retried for up to
        retry.visibility_timeout seconds before ObjectNotFoundError.
        """
        return self._call("read", key, lambda: self._read(key), referenced=referenced)

    def _write(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(self.path(key), data)

    def put(self, key: str, data: bytes) -> None:
        self._call("write", key, lambda: self._write(key, data))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Write only if nothing is there; True when this call created the object.

        Here a check then a write: two writers can both win. Backends that can do better
        override this and set capabilities.atomic_create. S3 cannot tell its own write whose reply
        was lost from a conflict, and answers True whenever the stored bytes equal data.
        """
        if self.exists(key):
            return False
        self.put(key, data)
        return True

    def exists(self, key: str) -> bool:
        # isfile, not exists: on object stores a key prefix looks like a directory.
        return bool(self._call("check", key, lambda: self.fs.isfile(self.path(key))))

    def size(self, key: str) -> int:
        return int(self._call("stat", key, lambda: self.fs.size(self.path(key))))

    def stat(self, key: str) -> tuple[int, float | None]:
        """(size, last-modified seconds since the epoch or None when the backend has no timestamps)."""
        info = self._call("stat", key, lambda: self.fs.info(self.path(key)))
        if info.get("type") == "directory":
            raise ObjectNotFoundError(f"{key} not found in {self.url}")
        return int(info.get("size") or 0), _timestamp(info)

    def _find(self, prefix: str) -> list[str]:
        try:
            return list(self.fs.find(self.path(prefix.rstrip("/"))))
        except FileNotFoundError as exc:
            if self._kind(exc) is _Kind.NO_BUCKET:
                raise
            return []

    def list(self, prefix: str) -> list[str]:
        """Keys under a folder-like prefix, recursively, sorted."""
        found = self._call("list", prefix, lambda: self._find(prefix))
        root = self.root + "/" if self.root else ""
        keys = []
        for p in found:
            p = p if not root or p.startswith(root) else "/" + p  # memory fs drops the leading slash
            keys.append(p[len(root):] if root and p.startswith(root) else p)
        return sorted(keys)

    def delete(self, key: str) -> None:
        """Remove key; a key that is already gone is not an error."""
        try:
            self._call("delete", key, lambda: self.fs.rm_file(self.path(key)))
        except ObjectNotFoundError:
            pass

    # --- batches ----------------------------------------------------------------------------
    def _is_async(self) -> bool:
        return bool(getattr(self.fs, "async_impl", False))

    def get_many(self, keys: list[str], *, referenced: bool = False) -> dict[str, bytes]:
        """Fetch several objects with bounded parallelism; a missing one raises ObjectNotFoundError."""
        unique = list(dict.fromkeys(keys))
        if not unique:
            return {}
        if self._is_async():
            from fsspec.asyn import sync

            pairs = sync(self.fs.loop, self._gather, unique, lambda k: self._aget(k, referenced))
            return dict(pairs)
        return dict(self._pool(unique, lambda k: (k, self.get(k, referenced=referenced))))

    def put_many(self, items: dict[str, bytes], if_absent: bool = True) -> dict[str, bool]:
        """Write several objects with bounded parallelism; per key, True when this call wrote it.

        With if_absent=False every key is overwritten (and reported True).
        """
        if not items:
            return {}
        if self._is_async():
            from fsspec.asyn import sync

            pairs = sync(self.fs.loop, self._gather, list(items), lambda k: self._aput(k, items[k], if_absent))
            return dict(pairs)

        def one(key: str) -> tuple[str, bool]:
            if if_absent:
                return key, self.put_if_absent(key, items[key])
            self.put(key, items[key])
            return key, True

        return dict(self._pool(list(items), one))

    def _pool(self, keys: list[str], fn: Callable[[str], tuple[str, T]]) -> list[tuple[str, T]]:
        """Thread-pool fan-out for blocking backends; the first failure cancels what has not started."""
        if len(keys) == 1 or self.max_workers == 1:
            return [fn(k) for k in keys]
        with ThreadPoolExecutor(max_workers=min(self.max_workers, len(keys)), thread_name_prefix="deltafs-io") as pool:
            futures = [pool.submit(fn, k) for k in keys]
            done, pending = wait(futures, return_when=FIRST_EXCEPTION)
            for fut in pending:
                fut.cancel()
            for fut in futures:
                if fut.done() and not fut.cancelled() and fut.exception() is not None:
                    raise fut.exception()  # type: ignore[misc]
            return [fut.result() for fut in futures]

    async def _gather(self, keys: list[str], fn: Callable[[str], Awaitable[tuple[str, T]]]) -> list[tuple[str, T]]:
        """Async fan-out on the backend's event loop, at most max_workers requests in flight."""
        gate = asyncio.Semaphore(self.max_workers)

        async def one(key: str) -> tuple[str, T]:
            async with gate:
                return await fn(key)

        tasks = [asyncio.ensure_future(one(k)) for k in keys]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:
                if not task.done():
                    task.cancel()
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]

    # Async single-object operations, used by the batches on async backends (s3fs, gcsfs).
    async def _aread(self, key: str) -> bytes:
        return bytes(await self.fs._cat_file(self.path(key)))

    async def _aget(self, key: str, referenced: bool) -> tuple[str, bytes]:
        return key, await self._acall("read", key, lambda: self._aread(key), referenced=referenced)

    async def _aput(self, key: str, data: bytes, if_absent: bool) -> tuple[str, bool]:
        path = self.path(key)
        if if_absent:
            if await self._acall("check", key, lambda: self.fs._isfile(path)):
                return key, False
        await self._acall("write", key, lambda: self.fs._pipe_file(path, data))
        return key, True


def _timestamp(info: dict[str, Any]) -> float | None:
    """The modification time in an fsspec info dict; backends spell it differently."""
    import datetime as dt

    for name in ("mtime", "LastModified", "last_modified", "updated", "timeCreated", "created"):
        value = info.get(name)
        if isinstance(value, dt.datetime):
            return (value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)).timestamp()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())[:300]


def _fs_type(path: str) -> str:
    """The filesystem type of the mount holding path ('' when unknown, e.g. not Linux)."""
    try:
        with open("/proc/mounts", encoding="utf-8", errors="replace") as fh:
            mounts = [line.split()[1:3] for line in fh if len(line.split()) >= 3]
    except OSError:
        return ""
    best, kind = "", ""
    real = os.path.realpath(path)
    for point, fstype in mounts:
        point = point.replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fstype
    return kind


# Network filesystems cache directory entries (NFS attribute cache, up to acdirmax=60 s), so a
# file another client just created may be missing from a listing or even an open() for a while.
_NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "fuse.sshfs", "9p", "lustre", "gpfs", "beegfs", "glusterfs",
               "fuse.glusterfs", "ceph", "fuse.ceph", "fuse.juicefs", "fuse.s3fs", "fuse.gcsfuse", "fuse.mountpoint-s3"}


class LocalObjectStore(ObjectStore):
    """A local or network-mounted directory, written with temp file + fsync + rename."""

    capabilities = Capabilities(atomic_put=True, atomic_create=True, durable=True)

    def __init__(self, fs: Any, root: str, url: str, *, retry: RetryPolicy | None = None,
                 max_workers: int = 8) -> None:
        super().__init__(fs, root, url, retry=retry, max_workers=max_workers)
        probe = self.root
        while probe and not os.path.exists(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)
        self.fstype = _fs_type(probe or "/")
        if self.fstype in _NETWORK_FS:
            self.declare(read_after_write=False)

    def _denied_hint(self) -> str:
        return "check file permissions"

    def _read(self, key: str) -> bytes:
        with open(self.path(key), "rb") as fh:
            return fh.read()

    def _write_temp(self, key: str, data: bytes) -> str:
        final = self.path(key)
        directory = os.path.dirname(final)
        _refuse_symlinked_dirs(self.root, directory)  # before makedirs, which would create through one
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".tmp-{uuid.uuid4().hex}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            _unlink_quietly(tmp)  # a full disk must not leave partial files behind
            raise
        return tmp

    def _fsync_dir(self, key: str) -> None:
        fd = os.open(os.path.dirname(self.path(key)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _write(self, key: str, data: bytes) -> None:
        tmp = self._write_temp(key, data)
        try:
            os.replace(tmp, self.path(key))
        except BaseException:
            _unlink_quietly(tmp)
            raise
        self._fsync_dir(key)

    def _create(self, key: str, data: bytes) -> bool:
        # link(2) fails with EEXIST if the name is taken: an atomic create of a complete file.
        tmp = self._write_temp(key, data)
        try:
            try:
                os.link(tmp, self.path(key))
            except FileExistsError:
                # NFSv3 may retransmit a LINK that already succeeded and answer EEXIST; the link
                # count of our temp file tells whether the name is ours (the classic NFS lock trick).
                if os.stat(tmp).st_nlink != 2:
                    return False
        finally:
            _unlink_quietly(tmp)
        self._fsync_dir(key)
        return True

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self._call("write", key, lambda: self._create(key, data))

    def exists(self, key: str) -> bool:
        return self._call("check", key, lambda: os.path.isfile(self.path(key)))

    def size(self, key: str) -> int:
        return self._call("stat", key, lambda: os.stat(self.path(key)).st_size)

    def stat(self, key: str) -> tuple[int, float | None]:
        st = self._call("stat", key, lambda: os.stat(self.path(key)))
        return st.st_size, st.st_mtime

    def _walk(self, prefix: str) -> list[str]:
        base = self.path(prefix.rstrip("/"))
        keys = []

        def fail(exc: OSError) -> None:
            if not isinstance(exc, FileNotFoundError):
                raise exc

        for dirpath, _dirs, files in os.walk(base, onerror=fail):
            for name in files:
                if name.startswith(".tmp-"):
                    continue
                full = os.path.join(dirpath, name)
                keys.append(os.path.relpath(full, self.root).replace(os.sep, "/"))
        return sorted(keys)

    def list(self, prefix: str) -> list[str]:
        return self._call("list", prefix, lambda: self._walk(prefix))

    def delete(self, key: str) -> None:
        try:
            self._call("delete", key, lambda: os.unlink(self.path(key)))
        except ObjectNotFoundError:
            pass


def _refuse_symlinked_dirs(root: str, directory: str) -> None:
    """Refuse to write below root through a symlinked directory (e.g. a planted chunks/ab -> /etc)."""
    rel = os.path.relpath(directory, root)
    probe = root
    for part in ([] if rel == "." else rel.split(os.sep)):
        probe = os.path.join(probe, part)
        if os.path.islink(probe):
            raise StoreError(f"{probe} is a symlink; deltafs writes only into real directories of the store (remove it)")


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class MemoryObjectStore(ObjectStore):
    """fsspec's memory:// filesystem; process-local, so a lock makes create-if-absent atomic."""

    capabilities = Capabilities(atomic_put=True, atomic_create=True, durable=False)
    _lock = threading.Lock()

    def put_if_absent(self, key: str, data: bytes) -> bool:
        with self._lock:
            return super().put_if_absent(key, data)
