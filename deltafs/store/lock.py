"""An advisory lock object in the store (locks/<name>.json), created with put_if_absent.

The lock records who holds it (host, pid, a random id) and when it was taken. A lock is stale when
its holder ran on this host and that process is gone, or when it is older than `stale_after`
seconds (a holder on another host that died). A stale lock is removed and taken over; the
removal re-reads the lock first so a fresh lock taken in between is not deleted by mistake.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from collections.abc import Iterator

from deltafs.errors import FormatError, LockHeldError, ObjectNotFoundError
from deltafs.format.keys import GC_LOCK_KEY, LOCK_PREFIX
from deltafs.format.records import LOCK_FORMAT, LOCK_MAX_BYTES, LockRecord, canonical_json, load_json
from deltafs.store.base import ObjectStore
log = logging.getLogger("deltafs")
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
    ns: str | None = None  # process_space() of the holder

    @property
    def age(self) -> float:
        return time.time() - self.created

    def describe(self) -> str:
        if self.pid < 0:  # unreadable: its age is unknown
            return f"an unreadable {self.key} (remove it if no gc is running)"
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
    return LockInfo(key, rec.owner, rec.host, rec.pid, rec.created, rec.purpose, data, rec.ns)


def is_stale(info: LockInfo, stale_after: float = DEFAULT_STALE_AFTER) -> bool:
    if info.age > stale_after:
        return True
    return info.pid > 0 and _visible_here(info.host, info.ns) and not _pid_alive(info.pid)


def process_space() -> str:
    """Which processes a pid names: this boot of this kernel and this pid namespace ("" where Linux does not say).
    Containers on one host often share its hostname (Docker's --network host) but not its pids, so a host name
    alone does not make another process's pid checkable here."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def _visible_here(host: str, ns: str | None) -> bool:
    """Whether a lock or marker's pid can be looked up from this process: the same host name, boot and pid
    namespace. A record without its namespace (an older deltafs) cannot be: it ages out instead."""
    return host == socket.gethostname() and bool(ns) and ns == process_space()


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
        return LockRecord.mine(self.owner, self.purpose, process_space()).to_bytes()

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

    def check_held(self) -> None:
        """Raise LockHeldError unless the lock object is still this one's. Two processes taking over one stale lock
        at once can both believe they hold it (each reads it stale, one deletes and creates its own, the other's
        delete then removes that): the loser finds out here, before its next destructive step."""
        current = read_lock(self.objects, self.key)
        if current is None or current.owner != self.owner:
            self.held = False
            taken = f"taken by {current.describe()}" if current is not None else "removed"
            raise LockHeldError(f"{self.objects.url}: {self.key} was {taken} while this {self.purpose} held it; "
                                "stopped before deleting anything more")

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
        except BaseException:
            # The job's own failure is the one to report (a store turned read-only fails the release too).
            try:
                self.release()
            except Exception as exc:
                log.warning("could not release %s: %s", self.key, exc)
            raise
        self.release()


# --- in-flight push markers ----------------------------------------------------------------------
# A push keeps locks/push-<id>.json alive (rewritten every ttl/4) from before its first chunk until
# after its commit. gc spares every unreferenced chunk written since the oldest live marker's push
# began (FORMAT.md, "gc and locking"). Times are the store's own clock (the marker object's mtime)
# plus durations measured by the pusher, so clock skew between hosts does not matter.
PUSH_MARKER_PREFIX = LOCK_PREFIX + "/push-"
DEFAULT_PUSH_MARKER_TTL = 600.0  # a marker not rewritten for this long belongs to a dead (or frozen) push
MARKER_MARGIN = 60.0  # slack for the store's mtime granularity and the time between a write and its mtime


@dataclass(frozen=True)
class PushMarker:
    key: str
    host: str
    pid: int
    elapsed: float  # seconds the push had been running when it last rewrote the marker
    ttl: float
    mtime: float | None  # when the store last saw the marker written (None: the backend does not say)

    ns: str | None = None  # process_space() of the pusher
    committing: bool = False  # between its last chunk check and its commit (see PushGuard.committing)

    def live(self, now: float) -> bool:
        if self.pid > 0 and _visible_here(self.host, self.ns) and not _pid_alive(self.pid):
            return False  # its process is gone (killed): nothing will commit what it wrote
        # A committing push may be frozen between its check and its manifest write (SIGSTOP, a suspended VM):
        # its marker then holds gc's deletions back as long as a gc lock would, not only for its ttl.
        return self.mtime is None or now - self.mtime < (max(self.ttl, DEFAULT_STALE_AFTER) if self.committing
                                                         else self.ttl)

    @property
    def protects_since(self) -> float:
        """Chunks modified at or after this time (store clock) may belong to this push."""
        return float("-inf") if self.mtime is None else self.mtime - self.elapsed - MARKER_MARGIN


def read_push_markers(objects: ObjectStore) -> list[PushMarker]:
    """Every push marker in the store; an unreadable one counts as a live push that began long ago."""
    out = []
    for key in objects.list(LOCK_PREFIX):
        if not key.startswith(PUSH_MARKER_PREFIX):
            continue
        try:
            _size, mtime = objects.stat(key)
            raw = load_json(objects.get(key, limit=LOCK_MAX_BYTES), key, max_bytes=LOCK_MAX_BYTES)
            ns = raw.get("ns")
            out.append(PushMarker(key, str(raw["host"]), int(raw["pid"]), float(raw["elapsed"]), float(raw["ttl"]), mtime,
                                  ns if isinstance(ns, str) else None, raw.get("committing") is True))
        except ObjectNotFoundError:
            continue  # finished in between
        except (ValueError, KeyError, TypeError, FormatError):
            out.append(PushMarker(key, "?", -1, float("inf"), DEFAULT_PUSH_MARKER_TTL, None))
    return out


class PushGuard:
    """Keeps this push's marker alive from a background thread while the push writes chunks.

    `lapsed` says whether the marker may have expired at some point (the process was frozen, or the
    store refused the rewrite): gc may then have removed chunks this push wrote, and the push must
    check them all before it commits.
    """

    def __init__(self, objects: ObjectStore, *, ttl: float | None = None) -> None:
        self.objects = objects
        # DELTAFS_PUSH_MARKER_TTL: for stores whose writes can stall longer than the default (and for tests).
        self.ttl = ttl if ttl is not None else float(os.environ.get("DELTAFS_PUSH_MARKER_TTL") or DEFAULT_PUSH_MARKER_TTL)
        self.key = f"{PUSH_MARKER_PREFIX}{uuid.uuid4().hex}.json"
        self._t0 = time.monotonic()
        self._last_ok: float | None = None
        self._lapsed = False
        self._committing = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> bytes:
        return canonical_json({"format": LOCK_FORMAT, "host": socket.gethostname(), "pid": os.getpid(),
                               "ns": process_space(), "elapsed": time.monotonic() - self._t0, "ttl": self.ttl,
                               "purpose": "push", "committing": self._committing})

    def committing(self, on: bool) -> None:
        """Say (synchronously) that this push is, or no longer is, between its last chunk check and its commit: a
        gc holds its chunk deletions back while such a marker is live (FORMAT.md, "Pushes and gc"). Raises if the
        store refuses the write: the push must not go on to check and commit without it."""
        self._committing = on
        self.objects.put(self.key, self._record())
        self._last_ok = time.monotonic()

    def refresh(self) -> None:
        """Rewrite the marker now (it then protects the push for another ttl)."""
        before = time.monotonic()
        try:
            self.objects.put(self.key, self._record())
        except Exception:  # a missed rewrite only makes the commit check more
            self._lapsed = True
            return
        if self._last_ok is not None and before - self._last_ok > self.ttl / 2:
            self._lapsed = True
        self._last_ok = before

    @property
    def lapsed(self) -> bool:
        if self._last_ok is None or time.monotonic() - self._last_ok > self.ttl / 2:
            return True
        return self._lapsed

    def _run(self) -> None:
        while not self._stop.wait(max(0.05, self.ttl / 4)):
            self.refresh()

    def __enter__(self) -> PushGuard:
        self.refresh()
        self._thread = threading.Thread(target=self._run, name="deltafs-push-marker", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with contextlib.suppress(Exception):
            self.objects.delete(self.key)
