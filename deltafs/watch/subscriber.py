"""The rollout-host subscriber: notice a new version, stage it while serving, switch at a boundary.

    sub = Subscriber("s3://bucket/run1", "/models/current", make_engine("sglang", url))
    sub.start()
    staged = sub.poll()      # pull + verify the newest version into DEST; the engine keeps serving
    ...                      # the orchestrator finishes its task
    applied = sub.apply()    # the only pause: the engine switches to the staged version

`run()` is the daemon loop around those two calls (what `deltafs watch` runs). Weights reach the
engine only from a directory that pull has verified; any failure leaves the engine on the version
it served (or sends it back there) and is retried later with backoff.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

from deltafs.engines import find_version_dir, weight_version
from deltafs.engines.base import Engine, SwitchError, Target
from deltafs.errors import (
    DeltafsError,
    DestinationError,
    EngineError,
    FormatError,
    LockHeldError,
    StoreError,
    StoreNotFoundError,
    VersionNotFoundError,
)
from deltafs.read.dest import LocalCheckpoint
from deltafs.read.pull import PullResult, pull
from deltafs.store.repo import CONFIG_KEY, Repository
from deltafs.watch.boundary import Boundary, Immediate
from deltafs.watch.ledger import (
    HostStatus,
    check_host_id,
    default_host_id,
    utcnow,
    write_status,
)
from deltafs.watch.notify import Notifier, jittered

log = logging.getLogger("deltafs.watch")


@dataclass(frozen=True)
class Staged:
    """A verified version in DEST, ready for the engine."""

    version: int
    path: str
    pull: PullResult
    noticed: float  # time.monotonic() when the watcher first saw the version


@dataclass(frozen=True)
class Applied:
    version: int
    pause_seconds: float  # the engine was not generating for this long
    sync_seconds: float  # from noticing the version to the engine serving it
    fallback: bool
    load_seconds: float = 0.0  # of the pause, the engine's own weight load

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "pause_s": round(self.pause_seconds, 4), "load_s": round(self.load_seconds, 4),
                "sync_s": round(self.sync_seconds, 4), "fallback": self.fallback, "at": utcnow()}


class NothingVerifiableError(DeltafsError):
    """No newer version could be fetched and verified; the host keeps serving what it has."""

    exit_code = 6


class Subscriber:
    """One store, one DEST, one engine (or none: pull only)."""

    def __init__(
        self,
        store: str,
        dest: str,
        engine: Engine | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        boundary: Boundary | None = None,
        host_id: str | None = None,
        ledger: bool = True,
        poll: float | None = None,
        fallback_poll: float = 30.0,
        heartbeat: float = 60.0,
        retry_base: float = 2.0,
        retry_max: float = 300.0,
        keep: int = 3,
        threads: int | None = None,
    ) -> None:
        self.store_url = store
        self.dest = os.path.abspath(os.path.expanduser(dest))
        self.engine = engine
        self.storage_options = storage_options
        self.boundary = boundary or Immediate()
        self.ledger = ledger
        self.poll_interval = poll
        self.fallback_poll = fallback_poll
        self.heartbeat = heartbeat
        self.retry_base = retry_base
        self.retry_max = retry_max
        self.keep = keep
        self.threads = threads
        self.stop_event = threading.Event()
        self.served: Target | None = None  # what the engine serves, known verified
        self.staged: Staged | None = None
        self._noticed: dict[int, float] = {}
        self._repo: Repository | None = None
        self._notifier: Notifier | None = None
        self.status = HostStatus(host_id=check_host_id(host_id or default_host_id()), dest=self.dest,
                                 engine=engine.kind if engine else "none",
                                 engine_url=getattr(engine, "url", None))

    # --- store access -------------------------------------------------------------------
    @property
    def repo(self) -> Repository:
        """The store, opened on first use and again after it failed (it may have come back)."""
        if self._repo is None:
            self._repo = Repository.open(self.store_url, self.storage_options)
            self.status.store_id = self._repo.store_id
        return self._repo

    def _forget_store(self) -> None:
        self._repo = None
        if self._notifier is not None:
            self._notifier.close()
            self._notifier = None

    @property
    def notifier(self) -> Notifier:
        if self._notifier is None:
            self._notifier = Notifier(self.repo.objects, poll=self.poll_interval, fallback_poll=self.fallback_poll)
            log.info("watching %s by %s", self.store_url, self._notifier.mode)
        return self._notifier

    # --- the Python API -------------------------------------------------------------------
    def start(self) -> None:
        """Find out what the engine serves, un-pause it if a killed watcher left it paused."""
        if self.engine is not None:
            try:
                self.engine.resume()
                reported = self.engine.served_version()
            except EngineError as exc:
                log.error("cannot ask the engine what it serves: %s", exc)
                reported = None
            self.served = self._local_target(reported) if reported is not None else None
            if reported is not None and self.served is None:
                log.warning("the engine serves weight_version %r, which is not a verified version in %s; "
                            "it will be switched to the newest version", reported, self.dest)
        else:
            state = LocalCheckpoint(self.dest).state()
            if state is not None:
                self.served = Target(state.path, weight_version(state.version))
        self.status.served_version = int(self.served.version) if self.served else None
        self._set_state("serving" if self.served else "starting")

    def poll(self) -> Staged | None:
        """Stage the newest version if it is newer than what is served; None when up to date.

        Raises on failure (store unreachable, nothing verifiable); the engine is untouched.
        """
        try:
            head = self.repo.head()
        except StoreError:
            self._forget_store()
            raise
        if head is None:
            if not self.repo.objects.exists(CONFIG_KEY):  # an empty listing can mean a vanished store
                self._forget_store()
                raise StoreNotFoundError(f"the store at {self.store_url} has disappeared (no {CONFIG_KEY})")
            return None
        served = int(self.served.version) if self.served else None
        if served is not None and head.version <= served:
            return None
        if self.staged is not None and self.staged.version >= head.version and os.path.isdir(self.staged.path):
            return self.staged
        self._noticed.setdefault(head.version, time.monotonic())
        self._set_state("staging")
        result = self._pull_newest(head.version, served)
        if served is not None and result.version <= served:
            return None
        noticed = self._noticed.get(result.version, time.monotonic())
        self.staged = Staged(result.version, result.path, result, noticed)
        self.status.staged_version = result.version
        self._set_state("waiting")
        return self.staged

    def apply(self) -> Applied | None:
        """Switch the engine to the staged version now (the caller is at a task boundary)."""
        staged = self.staged
        if staged is None:
            return None
        if not os.path.isdir(staged.path):  # DEST deleted under us: stage again, never load a guess
            self.staged = None
            self.status.staged_version = None
            raise DestinationError(f"staged version {staged.version} vanished from {staged.path}; staging it again")
        target = Target(staged.path, weight_version(staged.version))
        pause = load = 0.0
        if self.engine is not None:
            previous = self.served if self.served and os.path.isdir(self.served.path) else None
            self._set_state("switching")
            result = self.engine.switch(target, previous)
            pause, load = result.pause_seconds, result.load_seconds
        applied = Applied(staged.version, pause, time.monotonic() - staged.noticed, staged.pull.fallback, load)
        self.served = target
        self.staged = None
        self._noticed = {v: t for v, t in self._noticed.items() if v > staged.version}
        self.status.served_version = staged.version
        self.status.staged_version = None
        self.status.last_sync = applied.to_json()
        self.status.failures = 0
        self.status.last_error = None
        log.info("version %d live on %s: pause %.3fs (load %.3fs), total sync %.3fs (%s)", staged.version,
                 self.status.engine_url or self.status.engine, applied.pause_seconds, load, applied.sync_seconds,
                 _describe_pull(staged.pull))
        self._set_state("serving")
        return applied

    def sync(self) -> Applied | None:
        """One cycle: poll, wait for the boundary, apply. None when there was nothing to do."""
        staged = self.poll()
        if staged is None:
            self._beat()
            return None
        if self.engine is not None and not self.boundary.wait(self.engine, self.stop_event):
            return None
        return self.apply()

    # --- the daemon loop ----------------------------------------------------------------------
    def run(self) -> int:
        """Sync until stop(); returns 0, or the exit code of the error the host is stuck on."""
        self.start()
        try:
            _ = self.notifier  # watch before the first look at HEAD, so no push falls in between
        except (DeltafsError, OSError) as exc:
            log.warning("cannot watch %s yet: %s", self.store_url, exc)
        while not self.stop_event.is_set():
            delay: float | None = None
            try:
                self.sync()
                self._recovered()
            except SwitchError as exc:
                if exc.serving is not None and exc.serving != self.served:
                    self._now_serving(exc.serving)
                delay = self._failed(exc)
            except LockHeldError as exc:
                log.info("%s; trying again later", exc)
                delay = self._backoff(1)
            except StoreNotFoundError as exc:
                if self.status.store_id is not None:  # it existed: a vanished store is a failure
                    delay = self._failed(exc)
                else:  # started before the trainer's first push: wait quietly at the poll rate
                    if not self._said_waiting:
                        log.info("%s; waiting for the first version", exc)
                        self._said_waiting = True
                    delay = jittered(self.poll_interval or 5.0)
            except (DeltafsError, OSError) as exc:
                delay = self._failed(exc)
            if self.stop_event.is_set():
                break
            self._beat()
            if delay is not None:
                self.stop_event.wait(delay)
            else:
                try:
                    self.notifier.wait()
                except (DeltafsError, OSError) as exc:
                    self.stop_event.wait(self._failed(exc))
        self.close()
        return self.exit_code()

    def close(self) -> None:
        """Record "stopped" in the ledger and release the boundary and file watches."""
        self._set_state("stopped")
        self.boundary.close()
        if self._notifier is not None:
            self._notifier.close()
            self._notifier = None

    def stop(self) -> None:
        """Ask run() to finish after the current step (a switch in progress completes first)."""
        self.stop_event.set()
        if self._notifier is not None:
            self._notifier.poke()

    def exit_code(self) -> int:
        return self._last_exit if self.status.failures else 0

    # --- internals ------------------------------------------------------------------------
    _last_exit = 0

    def _pull_newest(self, newest: int, served: int | None) -> PullResult:
        """Pull the newest version that verifies; fall back to a full rebuild, then to older versions.

        A HEAD whose manifest is missing or unreadable makes the newest listed version the target.
        """
        candidates = [newest] + [v for v in reversed(self.repo.versions()) if v < newest and (served is None or v > served)]
        errors: list[str] = []
        for version in candidates[:3]:
            try:
                return self._pull_one(version)
            except (VersionNotFoundError, FormatError, NothingVerifiableError) as exc:
                errors.append(f"version {version}: {exc}")
                log.warning("version %d cannot be used: %s", version, exc)
            except StoreError:
                self._forget_store()
                raise
        raise NothingVerifiableError("no newer version could be fetched and verified; still serving "
                                     f"{self.served.version if self.served else 'nothing known'}: " + "; ".join(errors))

    def _pull_one(self, version: int) -> PullResult:
        """pull() verifies every byte and itself falls back to the nearest full version when the
        local base is unusable; what is left to handle here is a DEST of another store."""
        kwargs: dict[str, Any] = {"version": version, "keep": self.keep, "threads": self.threads}
        if self.served is not None:
            # pull's cleanup keeps the newest version directories by mtime; touching the one the
            # engine serves keeps it as the rollback target however many versions arrive meanwhile.
            try:
                os.utime(self.served.path)
            except OSError:
                pass
        try:
            return pull(self.repo, self.dest, **kwargs)
        except DestinationError as exc:
            log.warning("%s; replacing it with a full version of %s (the old content is moved aside)", exc, self.store_url)
            return pull(self.repo, self.dest, force=True, **kwargs)
        except (LockHeldError, StoreError, VersionNotFoundError):
            raise
        except DeltafsError as exc:
            raise NothingVerifiableError(f"version {version} cannot be verified: {exc}") from exc

    def _local_target(self, reported: str) -> Target | None:
        """The verified local directory of the version the engine reports, if there is one."""
        path = find_version_dir(self.dest, reported)
        return Target(path, reported) if path else None

    def _now_serving(self, target: Target) -> None:
        """The engine verifiably holds target although the switch reported a failure."""
        self.served = target
        self.status.served_version = int(target.version)
        if self.staged is not None and weight_version(self.staged.version) == target.version:
            self.staged = None
            self.status.staged_version = None

    def _recovered(self) -> None:
        """A cycle went through: the host is healthy again, even if there was nothing to switch."""
        if self.status.failures or self.status.state == "degraded":
            log.info("recovered after %d failed sync(s); serving version %s", self.status.failures,
                     self.served.version if self.served else "(unknown)")
            self.status.failures = 0
            self.status.last_error = None
            self._set_state("serving" if self.staged is None else "waiting")

    def _failed(self, exc: BaseException) -> float:
        self.status.failures += 1
        self.status.last_error = f"{type(exc).__name__}: {exc}"
        self.status.last_error_at = utcnow()
        self._last_exit = getattr(exc, "exit_code", 1)
        delay = self._backoff(self.status.failures)
        log.error("sync failed (%d in a row; next try in %.1fs): %s", self.status.failures, delay, exc)
        self._set_state("degraded")
        return delay

    def _backoff(self, failures: int) -> float:
        base = min(self.retry_max, self.retry_base * float(2 ** max(0, failures - 1)))
        return base * random.uniform(0.5, 1.0)  # full jitter: a fleet must not retry in lockstep

    def _set_state(self, state: str) -> None:
        self.status.state = state
        self._write_ledger()

    _last_write = 0.0
    _said_waiting = False

    def _beat(self) -> None:
        """Refresh the ledger entry now and then, so `deltafs status` can tell a live host from a dead one."""
        if time.monotonic() - self._last_write > self.heartbeat:
            self._write_ledger()

    def _write_ledger(self) -> None:
        if not self.ledger:
            return
        self._last_write = time.monotonic()
        try:
            objects = self.repo.objects
            # Never let a ledger write re-create a store directory that was removed or moved.
            if not objects.exists(CONFIG_KEY):
                raise StoreNotFoundError(f"no deltafs store at {self.store_url}")
        except (DeltafsError, OSError) as exc:
            log.debug("no ledger update, the store is unreachable: %s", exc)
            return
        write_status(objects, self.status)


def _describe_pull(res: PullResult) -> str:
    if not res.updated:
        return "already in DEST"
    how = "from a full version" if res.from_full else f"as a delta from version {res.previous}"
    fallback = " after the delta path failed" if res.fallback else ""
    return f"pulled {how}{fallback} in {res.seconds:.3f}s, {res.bytes_read / 1024:.0f} KiB read"
