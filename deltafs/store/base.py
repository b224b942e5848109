"""The object-store contract: get, put, put_if_absent, list, delete, capability flags, one retry loop.

Backends, one file each: local.py (a directory), memory.py, s3.py, gcs.py; fsspec.py holds what the
fsspec-based ones share, and fsspec stays inside this package. Correctness never rests on fsspec transactions: objects are
immutable and content-addressed, and a version commits through one create-if-absent write.

Every call goes through one retry loop: transient failures (timeouts, dropped connections,
throttling, 5xx) are retried with exponential backoff and full jitter, a bounded number of times;
permanent ones (missing key, access denied, missing bucket) become a deltafs error at once.
"""

from __future__ import annotations

import abc
import builtins
import enum
import errno
import random
import sys
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import Any, ClassVar, TypeVar
from collections.abc import Callable

from deltafs.errors import (
    DeltafsError,
    FormatError,
    IntegrityError,
    ObjectNotFoundError,
    StoreError,
    StoreNotFoundError,
)

T = TypeVar("T")


@dataclass(frozen=True)
class Capabilities:
    """What a backend guarantees; FORMAT.md's per-backend table is written from these."""

    atomic_put: bool  # a reader never sees a partially written object
    atomic_create: bool  # put_if_absent cannot let two writers both win
    # A completed put is visible at once to get/exists/list from every client. When False,
    # reads of keys that something else references (get(..., referenced=True)) wait for them.
    read_after_write: bool = True
    # Changes to HEAD and manifests/ raise file events here (inotify): a watcher may wait on them
    # (event_dirs()) instead of polling. False for remote stores and network mounts.
    file_events: bool = False
    # Requests worth keeping in flight: remote stores are latency-bound (many), a local disk is
    # bandwidth-bound (about the core count).
    concurrency: int = 16


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try before giving up; the defaults suit a flaky network, not a dead one."""

    attempts: int = 5  # total tries of one call on transient errors
    base_delay: float = 0.2  # seconds; doubled each retry
    max_delay: float = 5.0
    visibility_timeout: float = 10.0  # how long a referenced key may take to appear
    # Seconds one call to an object store (a read, a write, a stat, a delete; not a listing, which pages) may take
    # in all: the HTTP clients' own timeouts do not cover every wait (an S3 PUT waiting for "100 Continue" from a
    # server that stopped answering waits forever, and gcsfs sets none). Past it the call is abandoned and counts as
    # a transient failure. 0: no limit.
    request_timeout: float = 120.0

    def delay(self, attempt: int) -> float:
        return backoff(attempt, self.base_delay, self.max_delay)


def backoff(attempt: int, base: float, cap: float, *, jitter: bool = True, floor: float = 0.0) -> float:
    """Seconds to wait before retry number `attempt` (0-based): base * 2**attempt up to cap, jittered.

    The one backoff formula of deltafs. Jitter (AWS architecture blog) spreads a fleet of clients
    that failed together: a uniform draw between floor * ceiling and the ceiling (floor 0: full
    jitter; the watcher uses 0.5 so a failing host never retries at once). jitter=False gives the
    ceiling, for waits that must not shrink.
    """
    ceiling = min(cap, base * (2 ** min(attempt, 30)))
    return random.uniform(floor * ceiling, ceiling) if jitter else ceiling


class _Kind(enum.Enum):
    NOT_FOUND = "not found"
    NO_BUCKET = "no bucket"
    DENIED = "denied"
    EXISTS = "exists"
    TRANSIENT = "transient"
    DAMAGED = "damaged"  # the backend's own checksum of the bytes received failed: retried, then an integrity error
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
# A download whose bytes fail the backend's own checksum (botocore checks S3's x-amz-checksum-* headers by default):
# damaged in flight or at rest, like a chunk whose sha256 does not match.
_DAMAGED_NAMES = {"FlexibleChecksumError", "ChecksumError"}

_BACKEND_MODULES = ("botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "google", "fsspec", "s3fs", "gcsfs")


def _asyncio_timeout() -> tuple[type[BaseException], ...]:
    """asyncio's TimeoutError where it is its own class (Python 3.10) and asyncio is loaded (fsspec's async
    backends load it); not importing asyncio here keeps it out of a local store's start-up."""
    asyncio = sys.modules.get("asyncio")
    timeout = getattr(asyncio, "TimeoutError", TimeoutError)
    return () if timeout is TimeoutError else (timeout,)


def classify(exc: BaseException) -> _Kind | None:
    """What kind of failure exc is; None for exceptions that are not storage errors (bugs)."""
    if isinstance(exc, DeltafsError):
        return None
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & {"NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError"}:
        return _Kind.DENIED
    if names & _DAMAGED_NAMES:
        return _Kind.DAMAGED
    if names & _TRANSIENT_NAMES or isinstance(exc, (TimeoutError, ConnectionError, *_asyncio_timeout())):
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


class ObjectStore(abc.ABC):
    """Bytes under string keys below one root. Subclasses implement the primitives (_read, _write …)
    without retrying; the public methods add the one retry loop and deltafs errors."""

    capabilities: Capabilities  # the class's defaults; an instance may declare itself weaker
    default_workers: ClassVar[int] = 16

    def __init__(self, url: str, *, retry: RetryPolicy | None = None, max_workers: int | None = None) -> None:
        self.url = url
        self.retry = retry or RetryPolicy()
        self.max_workers = max(1, max_workers or self.default_workers)
        # Per instance, so a store can be declared weaker than its class (storage options, NFS).
        self.capabilities = replace(type(self).capabilities, concurrency=self.max_workers)

    def declare(self, **flags: Any) -> None:
        """Override capability flags, e.g. for an S3-compatible server that ignores If-None-Match."""
        self.capabilities = replace(self.capabilities, **flags)

    # --- what only some backends have ---------------------------------------------------------
    @property
    def local_root(self) -> str | None:
        """The directory holding the store when it is one on this machine (objects can be hard-linked), else None."""
        return None

    def event_dirs(self) -> list[str]:
        """Directories whose file events mean HEAD or a manifest may have changed; [] without file_events."""
        return []

    def leftovers(self, older_than: float, written_before: float = float("inf")) -> dict[str, int]:
        """Partial writes of killed writers older than `older_than` seconds and last written before the
        time `written_before`: name -> bytes (only local stores have them)."""
        return {}

    def remove_leftover(self, name: str) -> None:  # noqa: B027 - optional: most backends have no leftovers
        """Remove one name that leftovers() returned."""

    # --- primitives: one backend call each, no retrying ------------------------------------------
    @abc.abstractmethod
    def _read(self, key: str, limit: int | None) -> bytes:
        """The object's bytes; with limit, at most limit + 1 of them."""

    @abc.abstractmethod
    def _write(self, key: str, data: bytes) -> None: ...

    def _create(self, key: str, data: bytes, equal_is_ours: bool = True) -> bool:
        """Write only if absent. Here a check then a write: two writers can both win (atomic_create=False).
        equal_is_ours: see put_if_absent (only stores that can be answered "exists" to their own resend use it)."""
        if self._isfile(key):
            return False
        self._write(key, data)
        return True

    @abc.abstractmethod
    def _isfile(self, key: str) -> bool: ...

    @abc.abstractmethod
    def _stat(self, key: str) -> tuple[int, float | None]: ...

    @abc.abstractmethod
    def _find(self, prefix: str) -> list[str]:
        """Keys under a folder-like prefix, recursively; [] when there is nothing."""

    @abc.abstractmethod
    def _remove(self, key: str) -> None: ...

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
        if kind is _Kind.DAMAGED:
            return IntegrityError(f"{key} at {self.url} arrived damaged {attempts} times (the server's checksum does "
                                  f"not match the bytes received: {_one_line(exc)})")
        return StoreError(f"cannot {action} {key} at {self.url}: {_one_line(exc)}")

    def _call(self, action: str, key: str, fn: Callable[[], T], *, referenced: bool = False) -> T:
        """Run fn with the retry policy; storage failures come out as deltafs errors. The one retry loop."""
        attempt, since = 0, None
        while True:
            try:
                return fn()
            except Exception as exc:
                kind = self._kind(exc)
                if kind is None:
                    raise
                pause: float | None = None
                if kind in (_Kind.TRANSIENT, _Kind.DAMAGED) and attempt + 1 < self.retry.attempts:
                    pause = self.retry.delay(attempt)
                elif kind is _Kind.NOT_FOUND and referenced and not self.capabilities.read_after_write:
                    since = since if since is not None else time.monotonic()
                    if time.monotonic() - since < self.retry.visibility_timeout:
                        pause = backoff(min(attempt, 5), self.retry.base_delay, self.retry.max_delay, jitter=False)
                if pause is None:
                    raise self._error(kind, exc, action, key, attempt + 1) from exc
                time.sleep(pause)
                attempt += 1

    # --- single objects ---------------------------------------------------------------------
    def get(self, key: str, *, referenced: bool = False, limit: int | None = None) -> bytes:
        """The object's bytes.

        referenced=True says something committed names this key (HEAD → manifest, manifest →
        chunk), so on a backend without read-after-write visibility a miss is retried for up to
        retry.visibility_timeout seconds before ObjectNotFoundError. With limit, an object larger
        than limit bytes is refused (FormatError: no valid control file is that large) without
        reading more than limit + 1 bytes of it.
        """
        data = self._call("read", key, lambda: self._read(key, limit), referenced=referenced)
        if limit is not None and len(data) > limit:
            raise FormatError(f"{key} in {self.url} is larger than the {limit} bytes a valid one can be")
        return data

    def put(self, key: str, data: bytes) -> None:
        self._call("write", key, lambda: self._write(key, data))

    def put_if_absent(self, key: str, data: bytes, *, equal_is_ours: bool = True) -> bool:
        """Write only if nothing is there; True when this call created the object.

        Atomic only where capabilities.atomic_create says so. S3 and GCS cannot tell their own write
        whose reply was lost (a resend answered "exists") from an object that was there before: with
        equal_is_ours they answer True whenever the stored bytes equal data, which is right for
        records that are never written twice with the same bytes (manifests carry their creation
        time). Content-addressed objects pass False: equal bytes are all that any writer of that key
        leaves, so they say nothing, and "was there" is the safe answer (a push checks such a chunk
        before its commit; one it counts as its own write, gc may have removed: FORMAT.md).
        """
        return self._call("write", key, lambda: self._create(key, data, equal_is_ours))

    def exists(self, key: str) -> bool:
        return bool(self._call("check", key, lambda: self._isfile(key)))

    def size(self, key: str) -> int:
        return self.stat(key)[0]

    def stat(self, key: str) -> tuple[int, float | None]:
        """(size, last-modified seconds since the epoch or None when the backend has no timestamps)."""
        return self._call("stat", key, lambda: self._stat(key))

    def list(self, prefix: str) -> list[str]:
        """Keys under a folder-like prefix, recursively, sorted. Zero-byte "folder" markers (what the S3 console's
        "Create folder" or `rclone mkdir` leave: the prefix itself, or a key ending in "/") are not keys."""
        folder = prefix.rstrip("/")
        return sorted(k for k in self._call("list", prefix, lambda: self._find(prefix))
                      if k != folder and not k.endswith("/"))

    def delete(self, key: str) -> None:
        """Remove key; a key that is already gone is not an error."""
        try:
            self._call("delete", key, lambda: self._remove(key))
        except ObjectNotFoundError:
            pass

    # --- batches ----------------------------------------------------------------------------
    def get_many(self, keys: builtins.list[str], *, referenced: bool = False) -> dict[str, bytes]:
        """Fetch several objects, capabilities.concurrency at a time; a missing one raises ObjectNotFoundError."""
        unique = list(dict.fromkeys(keys))
        return dict(self._pool(unique, lambda k: (k, self.get(k, referenced=referenced))))

    def put_many(self, items: dict[str, bytes], if_absent: bool = True) -> dict[str, bool]:
        """Write several content-addressed objects in parallel; per key, True when this call wrote it (always, with
        if_absent=False; with if_absent, an object of equal bytes already there is False: put_if_absent)."""

        def one(key: str) -> tuple[str, bool]:
            if if_absent:
                return key, self.put_if_absent(key, items[key], equal_is_ours=False)
            self.put(key, items[key])
            return key, True

        return dict(self._pool(list(items), one))

    def _pool(self, keys: builtins.list[str], fn: Callable[[str], tuple[str, T]]) -> builtins.list[tuple[str, T]]:
        """Thread-pool fan-out; the first failure cancels what has not started."""
        if len(keys) <= 1 or self.capabilities.concurrency == 1:
            return [fn(k) for k in keys]
        workers = min(self.capabilities.concurrency, len(keys))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="deltafs-io") as pool:
            futures = [pool.submit(fn, k) for k in keys]
            _done, pending = wait(futures, return_when=FIRST_EXCEPTION)
            for fut in pending:
                fut.cancel()
            for fut in futures:
                if fut.done() and not fut.cancelled() and fut.exception() is not None:
                    raise fut.exception()  # type: ignore[misc]
            return [fut.result() for fut in futures]


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
