"""An advisory lock object in the store (locks/<name>.json), created with put_if_absent.

The lock records who holds it (host, pid, a random id) and when it was taken. A lock is stale when
its holder ran on this host and that process is gone, or when it is older than `stale_after`
seconds (a holder on another host that died). A stale lock is removed and taken over; the
removal re-reads the lock first so a fresh lock taken in between is not deleted by mistake.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid
from dataclasses import dataclass
from collections.abc import Iterator

from deltafs.errors import FormatError, LockHeldError, ObjectNotFoundError
from deltafs.format.keys import GC_LOCK_KEY
from deltafs.format.records import LOCK_MAX_BYTES, LockRecord
from deltafs.store.base import ObjectStore
DEFAULT_STALE_AFTER = 6 * 3600.0  # a gc of a very large store finishes well within this


@dataclass(frozen=True)
class LockInfo:
    key: str
    owner: str  # random id of this acquisition
    host: str
    pid: int
    created: float  # seconds since the epoch
    purpose: str
    raw: bytes

    @property
    def age(self) -> float:
        return time.time() - self.created

    def describe(self) -> str:
        return f"{self.purpose} by pid {self.pid} on {self.host}, taken {self.age:.0f}s ago"


def read_lock(objects: ObjectStore, key: str = GC_LOCK_KEY) -> LockInfo | None:
    """The current holder of `key`, or None. An unreadable lock counts as held since now."""
    try:
        data = objects.get(key, limit=LOCK_MAX_BYTES)
    except ObjectNotFoundError:
        return None
    except FormatError:  # too large, or not a regular file: held, by nobody we can name
        return LockInfo(key, "?", "?", -1, time.time(), "unreadable lock", b"")
    try:
        rec = LockRecord.from_bytes(data)
    except FormatError:
        return LockInfo(key, "?", "?", -1, time.time(), "unreadable lock", data)
    return LockInfo(key, rec.owner, rec.host, rec.pid, rec.created, rec.purpose, data)


def is_stale(info: LockInfo, stale_after: float = DEFAULT_STALE_AFTER) -> bool:
    if info.age > stale_after:
        return True
    if info.host == socket.gethostname() and info.pid > 0:
        return not _pid_alive(info.pid)
    return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, belongs to someone else
    return True


class StoreLock:
    """Exclusive lock held while a maintenance job changes the store."""

    def __init__(self, objects: ObjectStore, key: str = GC_LOCK_KEY, *, purpose: str = "gc",
                 stale_after: float = DEFAULT_STALE_AFTER) -> None:
        self.objects = objects
        self.key = key
        self.purpose = purpose
        self.stale_after = stale_after
        self.owner = uuid.uuid4().hex
        self.held = False

    def _record(self) -> bytes:
        return LockRecord.mine(self.owner, self.purpose).to_bytes()

    def try_acquire(self) -> LockInfo | None:
        """Take the lock; return None on success, else the live holder."""
        for _ in range(3):
            if self.objects.put_if_absent(self.key, self._record()):
                self.held = True
                return None
            holder = read_lock(self.objects, self.key)
            if holder is None:
                continue  # released in between: try again
            if not is_stale(holder, self.stale_after):
                return holder
            again = read_lock(self.objects, self.key)
            if again is not None and again.raw == holder.raw:  # still the stale one, not a fresh lock
                self.objects.delete(self.key)
        holder = read_lock(self.objects, self.key)
        return holder or LockInfo(self.key, "?", "?", -1, time.time(), "contended lock", b"")

    def acquire(self, wait: float = 0.0, poll: float = 1.0) -> None:
        """Take the lock, waiting up to `wait` seconds; raise LockHeldError otherwise."""
        deadline = time.monotonic() + wait
        while True:
            holder = self.try_acquire()
            if holder is None:
                return
            if time.monotonic() >= deadline:
                raise LockHeldError(
                    f"{self.objects.url} is locked ({self.key}: {holder.describe()}); "
                    f"wait for it to finish, or remove {self.key} if that process is gone"
                )
            time.sleep(min(poll, max(0.05, deadline - time.monotonic())))

    def release(self) -> None:
        if not self.held:
            return
        current = read_lock(self.objects, self.key)
        if current is not None and current.owner == self.owner:
            self.objects.delete(self.key)
        self.held = False

    @contextlib.contextmanager
    def hold(self, wait: float = 0.0) -> Iterator[StoreLock]:
        self.acquire(wait)
        try:
            yield self
        finally:
            self.release()
