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

import contextlib
import errno
import logging
import os
import threading
import time
from dataclasses import dataclass
from collections.abc import Iterator
from typing import Any

from deltafs import metrics
from deltafs.defaults import DEFAULT_GROUP_TIMEOUT, DEFAULT_RETRY_MAX
from deltafs.engines import weight_version
from deltafs.engines.base import Engine, EngineUnreachableError, NeedsRestartError, SwitchError, Target
from deltafs.engines.inflight import SwitchRecord
from deltafs.engines.switch import current_target, engine_answer, loaded_checksum, restart_needed, switch_engine
from deltafs.errors import (
    DeltafsError,
    DestinationError,
    EngineError,
    ForeignStoreError,
    FormatError,
    IntegrityError,
    LocalWriteError,
    LockHeldError,
    StoreError,
    StoreNotFoundError,
    VersionNotFoundError,
    exit_code,
    short_problem,
)
from deltafs.read.dest import LocalCheckpoint, read_version_state
from deltafs.progress import binary_size
from deltafs.read.pull import PullResult, pull
from deltafs.store.base import backoff
from deltafs.format.keys import CONFIG_KEY
from deltafs.store.repo import ForeignManifestError, Repository
from deltafs.watch.boundary import Boundary, Immediate
from deltafs.watch.group import GroupNotReadyError, by_version, group_members, held_versions, ready_hosts, stable_path
from deltafs.watch.ledger import (
    HostStatus,
    check_host_id,
    default_host_id,
    ledger_key,
    record_checksum,
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


class NothingVerifiableError(IntegrityError):
    """No newer version could be fetched and verified; the host keeps serving what it has (exit 6)."""


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
        retry_max: float = DEFAULT_RETRY_MAX,
        keep: int = 3,
        recycle: bool = True,
        threads: int | None = None,
        engine_group: str | None = None,
        engine_hosts: int = 1,
        group_timeout: float = DEFAULT_GROUP_TIMEOUT,
        group_poll: float = 2.0,
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
        self.recycle = recycle
        self.threads = threads
        self.stop_event = threading.Event()
        self.served: Target | None = None  # what the engine serves, known verified
        self.staged: Staged | None = None
        self._noticed: dict[int, float] = {}
        self._repo: Repository | None = None
        self._notifier: Notifier | None = None
        self.engine_group = engine_group
        self.engine_hosts = max(1, int(engine_hosts))
        self.group_timeout = group_timeout
        self.group_poll = group_poll
        self._group_since: dict[int, float] = {}
        self._relearn = False  # the engine was lost mid-switch: ask it again what it serves
        self._resume_pending = False  # a switch could not resume generation: resume it before anything else
        self._handled_record: dict[str, Any] | None = None  # a switch record waited for that cannot be removed
        self._ledger_lock = threading.Lock()  # the heartbeat thread's writes and the loop's, one at a time
        self._unconfirmed = False  # served was inferred from DEST's link: reload once to be sure
        self._checked_store: str | None = None  # the store id whose checkpoint DEST was last found to hold
        self.status = HostStatus(host_id=check_host_id(host_id or default_host_id()), dest=self.dest,
                                 engine=engine.kind if engine else "none",
                                 engine_url=getattr(engine, "url", None), engine_group=engine_group,
                                 engine_hosts=self.engine_hosts)

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
            record = SwitchRecord(self.dest)
            pending = record.pending()
            if pending is not None:
                # While the killed switch's load may run, this host's ledger entry goes on saying what that watcher
                # left (served, and the version loading as staged), refreshed: a group's followers keep those
                # versions on their disks only while the entry says so (an entry of this process's, with nothing
                # served yet, let them delete the version the engine was loading: adversarial pass).
                self._adopt_entry(pending)
                with self._beating():
                    over = record.wait_for_killed(self.engine, self.stop_event)
            else:
                over = record.wait_for_killed(self.engine, self.stop_event)
            if not over:
                log.warning("stopped while a killed switch's load may still run: the engine and this host's ledger "
                            "entry are left as they are")
                self._leave_entry = True
                return
            try:
                if not self._resume_unless_switching():
                    self._leave_entry = True
                    return
            except LockHeldError:
                log.warning("another deltafs process is switching the engine of %s; not resuming it", self.dest)
            except EngineUnreachableError as exc:  # not running (yet): nothing there is paused
                log.error("cannot resume the engine: %s", exc)
            except EngineError as exc:  # it answered, and may be paused: every cycle tries again until it works
                log.error("cannot resume the engine: %s", exc)
                self._resume_pending = True
            self._learn_served(first=True)
        else:
            state = LocalCheckpoint(self.dest).state()
            if state is not None:
                self.served = Target(state.path, weight_version(state.version))
        if self.engine_group and self.served is not None:
            self._link_for_group(self.served)
        self.status.served_version = int(self.served.version) if self.served else None
        self.status.staged_version = None  # (what a killed switch's wait took over, _adopt_entry)
        self._set_state("serving" if self.served else "starting")

    def _show_loading(self, record: dict[str, Any]) -> None:
        """The ledger entry while another process's switch may still load: state "switching", its version staged
        (an engine group's other hosts keep it on their disks meanwhile)."""
        text = str(record.get("version", ""))
        if text.isascii() and text.isdigit():
            self.status.staged_version = int(text)
        self._set_state("switching")

    def _settled_state(self) -> str:
        return "needs-restart" if self.status.needs_restart else "serving" if self.staged is None else "waiting"

    def _adopt_entry(self, record: dict[str, Any]) -> None:
        """Take over served and staged from this host's last ledger entry (the killed watcher's), the version the
        switch record names as staged, state "switching"; written at once."""
        try:
            previous = HostStatus.from_bytes(self.repo.objects.get(ledger_key(self.status.host_id)))
        except (DeltafsError, OSError, ValueError) as exc:
            log.debug("no ledger entry to take over: %s", exc)
            previous = None
        if previous is not None and previous.store_id in (None, self.status.store_id):
            self.status.served_version = previous.served_version
            self.status.staged_version = previous.staged_version
        self._show_loading(record)

    def _link_for_group(self, target: Target) -> None:
        """DEST.deltafs/by-version/v<N> for the version this host serves or holds at start: the leader's rollback
        sends that path to every host, and a follower that started on a DEST pulled beforehand had no link to it
        (adversarial pass: the rollback named a path missing on the follower's disk)."""
        text = target.version
        if not (text.isascii() and text.isdigit()) or not os.path.isdir(target.path):
            return
        try:
            stable_path(self.dest, int(text), target.path)
        except OSError as exc:
            log.warning("cannot link version %s for engine group %s: %s", text, self.engine_group, exc)

    def _resume_unless_switching(self) -> bool:
        """Un-pause the engine (a killed watcher may have left it paused), but not while another process switches
        this DEST's engine (a cron `pull --engine`): its load may be running, and a resume would let generation go
        on mid-load. A DEST whose lock cannot be made yet (nothing pulled, no sidecar) has no such process.

        Under the lock, a switch record whose load may still run (its process was killed after it took the lock)
        is waited for first, without the lock. False when stop ended that wait: nothing was resumed."""
        assert self.engine is not None
        record = SwitchRecord(self.dest)
        waited: dict[str, Any] | None = None
        while True:
            with contextlib.ExitStack() as held:
                try:
                    held.enter_context(LocalCheckpoint(self.dest).lock(wait=False, name="engine.lock"))
                except (DestinationError, OSError):
                    pass  # no lock to take: resume all the same (LockHeldError, another's switch, passes on)
                pending = record.pending()
                if pending is None or pending == waited:  # none, or one waited for that could not be removed
                    stale = record.read()  # a record whose time is up: its load is over
                    if stale is not None:
                        record.clear(only=stale)
                    self.engine.resume()
                    return True
            self._show_loading(pending)
            if not record.wait_for_killed(self.engine, self.stop_event):
                return False
            self.status.staged_version = self.staged.version if self.staged is not None else None
            self._set_state(self._settled_state())
            waited = pending

    def _keep_dest_on(self, staged: Staged) -> None:
        """DEST names the version now served: one pointed back by hand while it waited (to an older version, or at
        nothing) is pointed at it again, or `launch-args` and a restart would load the older one (adversarial pass).
        Never over a newer version of this store that another pull installed meanwhile."""
        local = LocalCheckpoint(self.dest)
        name = os.path.basename(staged.path)
        if local.linked_name() == name:
            return
        try:
            with local.lock(wait=False):
                state = local.state()
                if local.linked_name() == name or (state is not None and state.store_id == self.repo.store_id
                                                   and state.version > staged.version):
                    return
                log.warning("%s pointed to %s, not version %d that the engine now serves; pointing it back",
                            self.dest, state.version if state is not None else local.linked_name(), staged.version)
                local.point_to(name)
        except (DeltafsError, OSError) as exc:  # another pull holds DEST (it moves the link itself), or DEST's disk
            log.warning("cannot point %s at version %d: %s", self.dest, staged.version, exc)

    def _learn_served(self, *, first: bool = False) -> bool:
        """Ask the engine what it serves (weight_version, else model_path) and record its checksum; False when it
        cannot be asked."""
        assert self.engine is not None
        try:
            reported, path = answer = engine_answer(self.engine)
            found = current_target(self.engine, self.dest, trust_dest_link=first, answer=answer)
            loaded_from = path if found is not None and reported != found.version else None
        except EngineError as exc:
            log.error("cannot ask the engine what it serves: %s", exc)
            return False
        self._unconfirmed = False
        self._engine_said, self._engine_path_said = reported, path
        if found is not None and reported != found.version:
            # Started without --weight-version: known from model_path. If that path is DEST itself, it
            # names what DEST pointed to at launch; reload once so the engine reports a version.
            self._unconfirmed = os.path.abspath(loaded_from or "").rstrip("/") == self.dest
            log.info("the engine reports weight_version %r; it loaded %s, version %s%s", reported, found.path,
                     found.version, " (reloading it once to be sure)" if self._unconfirmed else "")
        elif found is None and reported is not None:
            hint = (f" (start SGLang with the arguments `deltafs launch-args {self.dest}` prints)"
                    if getattr(self.engine, "kind", None) == "sglang" else "")
            log.warning("the engine serves weight_version %r, which is not a verified version in %s; it will be "
                        "switched to the newest version%s", reported, self.dest, hint)
        self.served = found
        self.status.served_version = int(found.version) if found else None
        if found is not None:
            record_checksum(self.status, int(found.version), loaded_checksum(self.engine))
            if self.staged is not None and self.staged.version <= int(found.version):
                self.staged = None  # e.g. a slow load that finished after the switch gave up waiting
                self.status.staged_version = None
        return True

    def poll(self) -> Staged | None:
        """Stage the newest version if it is newer than what is served; None when up to date.

        Raises on failure (store unreachable, nothing verifiable); the engine is untouched.
        """
        try:
            return self._poll()
        except ForeignManifestError as exc:
            # The store was deleted and made again (a new run) since it was opened, and no poll saw it gone: open
            # it afresh; this poll then compares DEST's store with it and replaces the old run's checkpoint.
            log.warning("%s: the store at %s was made again since it was opened; opening it afresh", exc,
                        self.store_url)
            return self._poll()

    def _poll(self) -> Staged | None:
        try:
            head = self.repo.head()
        # Unreachable, or made again since it was opened; or a manifest listed and gone when read: the newest version
        # is never gc'd, so the store was deleted meanwhile (the next poll must open the new run's store, whose
        # lower HEAD would otherwise never be compared with DEST's store at all).
        except (StoreError, ForeignManifestError, VersionNotFoundError):
            self._forget_store()
            raise
        if head is None:
            if not self.repo.objects.exists(CONFIG_KEY):  # an empty listing can mean a vanished store
                self._forget_store()
                raise StoreNotFoundError(f"the store at {self.store_url} has disappeared (no {CONFIG_KEY})")
            return None
        served = int(self.served.version) if self.served and not self._unconfirmed else None
        if served is not None and self._checked_store != self.repo.store_id:
            # Once per store opened: a version number says nothing across stores. A store deleted and pushed again
            # at the same URL (a new run) starts over at version 1, and DEST's version 3 of the old run must not
            # count as newer than it.
            state = LocalCheckpoint(self.dest).state()
            if state is not None and state.store_id != self.repo.store_id:
                log.warning("%s holds version %s of another store (%s); the store at %s is %s now: replacing it with "
                            "this store's newest version", self.dest, state.version, state.store_id[:8],
                            self.store_url, self.repo.store_id[:8])
                served = None
            else:
                self._checked_store = self.repo.store_id
        if served is not None and head.version <= served:
            return None
        if self.staged is not None and self.staged.version >= head.version and os.path.isdir(self.staged.path):
            return self.staged
        self._noticed.setdefault(head.version, time.monotonic())
        self._set_state("staging")
        result = self._pull_newest(head.version, served)
        self._rehash = False
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
        local = LocalCheckpoint(self.dest)
        state = local.version_state(os.path.basename(staged.path))
        # An engine that loads from disk is about to have its files read whole (switch_engine warms the page cache
        # first): hashing them on that read costs about as much as the read, and catches what the quick check
        # cannot (a file edited in place, its size and mtime kept). Others: sizes and install mtimes.
        full = self.engine is not None and bool(getattr(self.engine, "loads_from_disk", False))
        changed = "its state record is unreadable" if state is None else local.check_files(state, full=full)
        if changed is not None:  # a stray writer while it waited: the engine must not load it
            self.staged = None
            self.status.staged_version = None
            self._rehash = True  # staged again with every file hashed: a change that kept size and mtime is repaired
            raise DestinationError(f"staged version {staged.version} changed on disk while it waited ({changed}); "
                                   "staging it again")
        target = Target(staged.path, weight_version(staged.version))
        if self.engine_group:  # every host of the engine loads the same path from its own disk
            target = Target(stable_path(self.dest, staged.version, staged.path), target.version)
        pause = load = 0.0
        checksum = None
        if self.engine is not None:
            previous = self.served if self.served and os.path.isdir(self.served.path) else None
            if previous is not None:
                prev_state = local.version_state(os.path.basename(os.path.realpath(previous.path)))
                if prev_state is None or local.check_files(prev_state) is not None:
                    log.warning("version %s's files changed on disk since it was loaded: no rollback to them if this "
                                "switch fails", previous.version)
                    previous = None
            if self.engine_group:
                # No group wait for a version the engine already serves (another process switched it): asked again
                # under the lock below, this only spares the wait.
                ahead = self._serves_newer(staged.version)
                if ahead is not None:
                    self._already_serving(ahead, staged)
                    return None
                self._wait_for_group(staged.version)
                if previous is not None:
                    previous = self._group_rollback(previous)
            self._set_state("switching")
            try:
                # One switch per DEST's engine at a time, as reload_engine (cron mode) takes it: SGLang cannot take
                # two updates at once, and the other's resume would end this one's pause mid-load.
                with LocalCheckpoint(self.dest).lock(wait=False, name="engine.lock"):
                    # A switch killed mid-load (a cron run's, after this watcher's last look) left its record: its
                    # load may run, and a second update breaks SGLang (adversarial pass: sent 6.5 s into it).
                    if not SwitchRecord(self.dest).wait_for_killed(self.engine, self.stop_event):
                        log.warning("stopped while a killed switch's load may still run; version %d not switched to",
                                    staged.version)
                        self._leave_entry = True
                        return None
                    ahead = self._serves_newer(staged.version)
                    if ahead is None:
                        with SwitchRecord(self.dest).around(self.engine, target):
                            result = switch_engine(self.engine, target, previous, warm=not full)
            except NeedsRestartError as exc:
                self.status.needs_restart = {"version": staged.version, "reason": exc.reason}
                self._set_state("needs-restart")
                raise
            if ahead is not None:
                self._already_serving(ahead, staged)
                return None
            pause, load, checksum = result.pause_seconds, result.load_seconds, result.checksum
        applied = Applied(staged.version, pause, time.monotonic() - staged.noticed, staged.pull.fallback, load)
        self._keep_dest_on(staged)
        self._engine_said = self._engine_path_said = None
        if self.engine is not None:  # what it reports after this switch: what _check_engine compares with
            with contextlib.suppress(EngineError):
                self._engine_said, self._engine_path_said = engine_answer(self.engine)
        self.served = target
        self.staged = None
        self._unconfirmed = False
        self._noticed = {v: t for v, t in self._noticed.items() if v > staged.version}
        self.status.served_version = staged.version
        self.status.staged_version = None
        self.status.needs_restart = None
        self.status.group_wait = None
        record_checksum(self.status, staged.version, checksum)
        self.status.last_sync = applied.to_json()
        self.status.failures = 0
        self.status.last_error = None
        if self.engine is None:
            log.info("version %d is in %s (no engine to switch), total sync %.3fs (%s)", staged.version, self.dest,
                     applied.sync_seconds, _describe_pull(staged.pull))
        else:
            log.info("version %d live on %s: pause %.3fs (load %.3fs), total sync %.3fs (%s)", staged.version,
                     self.status.engine_url or self.status.engine, applied.pause_seconds, load, applied.sync_seconds,
                     _describe_pull(staged.pull))
        self._metrics(switches=1, pause=applied.pause_seconds, sync=applied.sync_seconds)
        self._set_state("serving")
        return applied

    def sync(self) -> Applied | None:
        """One cycle: poll, wait for the boundary, apply. None when there was nothing to do."""
        found = SwitchRecord(self.dest).read() if self.engine is not None else None
        killed = found is not None and found != self._handled_record
        if self.engine is not None and (self._resume_pending or killed):
            # A switch could not resume generation: the engine may still be paused, serving nobody. Until a resume
            # goes through, every cycle tries again and fails (the host stays degraded in the ledger); the cycle that
            # went through next cleared the failure while the engine stayed paused (adversarial pass). An engine that
            # cannot be reached at all was restarted or moved: nothing of it is paused, and what it serves is asked.
            # Likewise after another process's switch left its record (a cron run killed mid-load left the engine
            # paused beside a running watcher): its load is waited for, then the engine resumed and asked what it
            # serves. (A live process's switch holds the engine lock: LockHeldError, tried again later.)
            try:
                if not self._resume_unless_switching():
                    self._leave_entry = True  # stopped while that load may still run: the entry says so
                    return None
                if self._resume_pending:
                    log.info("generation resumed on %s", self.status.engine_url or self.status.engine)
                self._relearn = self._relearn or killed
                if killed and SwitchRecord(self.dest).read() == found:
                    # Waited for, and still there: it cannot be removed (a read-only sidecar). Handled once, not at
                    # every cycle (each took the engine lock, and cron runs beside it found it held: re-check).
                    log.warning("cannot remove the switch record %s; its switch is over", SwitchRecord(self.dest).path)
                    self._handled_record = found
            except EngineUnreachableError:
                self._relearn = True
            self._resume_pending = False
        if self.engine is not None and (self._relearn or self.status.needs_restart):
            # The engine was lost mid-switch, or an operator may have restarted it at the staged version.
            self._relearn = not self._learn_served()  # asked again next cycle while it cannot be asked
            wanted = self.status.needs_restart
            if wanted and self.served is not None and int(self.served.version) >= int(wanted["version"]):
                log.info("the engine was restarted at version %s; the restart is done", self.served.version)
                self.status.needs_restart = None
                self.staged = None
                self.status.staged_version = None
                self._set_state("serving")
        staged = self.poll()
        if staged is None:
            self._check_engine()
            staged = self.staged  # staged there when the engine turned out to serve something else
        if staged is None:
            self._beat()
            return None
        wanted = self.status.needs_restart
        if wanted and staged.version == int(wanted["version"]):  # still not hot-switchable; keep serving
            self._set_state("needs-restart")
            raise NeedsRestartError(weight_version(staged.version), str(wanted.get("reason")))
        if self.engine is not None and self.served is not None:
            # A version only a restart can serve is known now: waiting for a boundary (up to --max-wait of an idle
            # one) would only delay saying so.
            reason = restart_needed(self.served.path, staged.path)
            if reason is not None:
                self.status.needs_restart = {"version": staged.version, "reason": reason}
                self._set_state("needs-restart")
                raise NeedsRestartError(weight_version(staged.version), reason)
        if self.engine is not None and not self.boundary.wait(self.engine, self.stop_event):
            return None
        if self.engine is not None and self.boundary.name != "immediate":
            self._catch_up()
        return self.apply()

    def _catch_up(self) -> None:
        """After a wait for the boundary: stage what the trainer pushed meanwhile, so this boundary switches to the
        newest version (bursts coalesce) instead of to the one it waited with and the newest a whole task later. If
        that cannot be staged now, the version in hand is switched to."""
        staged = self.staged
        try:
            head = self.repo.head()
            if staged is None or head is None or head.version <= staged.version:
                return
            log.info("version %d was pushed while version %d waited for the boundary; staging it first", head.version,
                     staged.version)
            newer = self.poll()
            if newer is not None and newer is not staged and self.engine_group:
                ready, _ = ready_hosts(self.repo.objects, self.engine_group, newer.version,
                                       store_id=self.status.store_id)
                if len(ready | {self.status.host_id}) < self.engine_hosts:
                    # Its hosts do not all hold it yet: this boundary switches the group to the version they hold.
                    log.info("not every host of engine group %s holds version %d yet; switching to version %d at "
                             "this boundary", self.engine_group, newer.version, staged.version)
                    self._stage_again(staged)
                    return
            served = self.served
            if newer is not None and newer is not staged and served is not None and os.path.isdir(staged.path):
                reason = restart_needed(served.path, newer.path)
                if reason is not None and restart_needed(served.path, staged.path) is None:
                    # Only a restart can serve the newer one: switch to the version in hand now (it is newer than
                    # what the engine serves); the next cycle says the newer one needs the restart.
                    log.info("version %d needs an engine restart (%s); switching to version %d at this boundary",
                             newer.version, reason, staged.version)
                    self._stage_again(staged)
        except (DeltafsError, OSError) as exc:
            log.warning("cannot stage the versions pushed while waiting for the boundary (%s); switching to version %d",
                        exc, staged.version if staged else -1)
            if staged is not None and os.path.isdir(staged.path):
                self._stage_again(staged)

    def _stage_again(self, staged: Staged) -> None:
        """Make `staged` (the version in hand before the catch-up) the one this boundary switches to."""
        self.staged = staged
        self.status.staged_version = staged.version

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
                with self._beating():
                    self.sync()
                self._recovered()
            except (DeltafsError, OSError) as exc:
                delay = self._after(exc)
            if self.stop_event.is_set():
                break
            self._beat()
            if delay is not None:
                with self._beating():  # a degraded host's backoff reaches --retry-max (300 s): still alive
                    self.stop_event.wait(delay)
            else:
                try:
                    self.notifier.wait()
                except (DeltafsError, OSError) as exc:
                    self.stop_event.wait(self._failed(exc))
        self.close()
        return self.exit_code()

    def once(self) -> Applied | None:
        """One cycle (`deltafs watch --once`), recorded in the ledger as run() records its cycles: a failure leaves
        the host degraded with its error (a cron fleet's failures never reached `deltafs status`: adversarial pass).
        Raises what the cycle raised."""
        try:
            with self._beating():
                applied = self.sync()
        except (DeltafsError, OSError) as exc:
            self._after(exc, again=False)
            raise
        self._recovered()
        return applied

    def _after(self, exc: DeltafsError | OSError, *, again: bool = True) -> float:
        """Record a failed cycle; the delay before the next (again: whether there is one, for the log line)."""
        if isinstance(exc, SwitchError):
            if exc.serving is not None and exc.serving != self.served:
                self._now_serving(exc.serving)
            elif exc.serving is None and not exc.rolled_back:
                self._relearn = True  # died, restarted or still loading: what it serves is unknown
            if exc.paused:
                self._resume_pending = True
            return self._failed(exc, again=again)
        if isinstance(exc, NeedsRestartError):
            log.error("%s; still serving version %s. Restart the engine with: deltafs launch-args %s",
                      exc, self.served.version if self.served else "?", self.dest)
            return jittered(self.fallback_poll)
        if isinstance(exc, GroupNotReadyError):
            if exc.timed_out:
                return self._failed(exc, again=again)
            log.info("%s", exc)
            return jittered(self.group_poll)
        if isinstance(exc, LockHeldError):
            log.info("%s; trying again later", exc)
            return self._backoff(1)
        if isinstance(exc, StoreNotFoundError) and self.status.store_id is None:
            # Started before the trainer's first push: wait quietly at the poll rate (a store that existed and
            # vanished is a failure, below).
            if not self._said_waiting:
                log.info("%s; waiting for the first version", exc)
                self._said_waiting = True
            return jittered(self.poll_interval or 5.0)
        return self._failed(exc, again=again)

    @contextlib.contextmanager
    def _beating(self) -> Iterator[None]:
        """Refresh the ledger entry every heartbeat while a long step runs: a pull of a large model, a wait for the
        boundary, an engine's load (up to --load-timeout). Silent for more than five minutes, the entry no longer
        counts as live: `deltafs status` called the host stale mid-load, and an engine group's followers stopped
        keeping the versions its engine was loading from their disks (adversarial pass)."""
        if not self.ledger:
            yield
            return
        done = threading.Event()

        def beat() -> None:
            while not done.wait(max(self.heartbeat, 0.1)):  # (a heartbeat of 0, as tests use, must not spin)
                repo = self._repo  # never opened here: the main thread opens and forgets the store
                if repo is None:
                    continue
                try:
                    self._write_ledger(repo)
                except Exception as exc:  # noqa: BLE001 - e.g. the status changed while it was written: next beat
                    log.debug("heartbeat not written: %s", exc)

        thread = threading.Thread(target=beat, name="deltafs-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join(5.0)  # a write in progress (under the ledger lock, so never after a newer one)

    _leave_entry = False  # stopped while a killed switch's load may run: the entry keeps saying what it loads

    def close(self, *, stopped: bool = True) -> None:
        """Record "stopped" in the ledger (unless stopped=False: a one-shot `watch --once` beside a daemon or from
        cron, which must not mark the host stopped) and release the boundary and file watches."""
        if stopped and not self._leave_entry:
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
        missing = False
        for version in candidates[:3]:
            try:
                return self._pull_one(version)
            except ForeignManifestError:
                # The store was deleted and made again (a new run) between two polls: open it afresh, and the next
                # poll compares DEST's store with it (it replaces the old run's checkpoint).
                self._forget_store()
                raise
            except (VersionNotFoundError, FormatError, NothingVerifiableError) as exc:
                missing = missing or isinstance(exc, VersionNotFoundError)
                errors.append(f"version {version}: {exc}")
                log.warning("version %d cannot be used: %s", version, exc)
            except StoreError:
                self._forget_store()
                raise
        if missing:  # a version listed a moment ago is gone: the store may have been deleted (and made again)
            self._forget_store()
        raise NothingVerifiableError("no newer version could be fetched and verified; still serving "
                                     f"{self.served.version if self.served else 'nothing known'}: " + "; ".join(errors))

    def _pull_one(self, version: int) -> PullResult:
        """pull() verifies every byte and itself falls back to the nearest full version when the
        local base is unusable; what is left to handle here is a DEST of another store."""
        # pull's cleanup and recycling spare the newest version directories by mtime; touching the one the engine
        # serves keeps it as the rollback target however many versions arrive meanwhile, and on an engine group's
        # follower the ones the group's engine serves and is switching to (its ranks on this host read them here),
        # which are kept on top of --keep.
        in_use = self._group_versions_in_use()
        kwargs: dict[str, Any] = {"version": version, "keep": self.keep + len(in_use), "threads": self.threads,
                                  "recycle": self.recycle, "verify_files": self._rehash}
        for path in ([self.served.path] if self.served is not None else []) + in_use:
            try:
                os.utime(path)
            except OSError:
                pass
        try:
            try:
                return pull(self.repo, self.dest, **kwargs)
            except LocalWriteError as exc:
                if getattr(exc, "errno", None) not in (errno.ENOSPC, errno.EDQUOT) or self.keep <= 2:
                    raise
                # The watcher keeps three versions; a DEST disk with room for two (enough for pull) still takes
                # the update when the oldest kept version, never the served one, gives its files to the new one.
                log.warning("%s; pulling again keeping two versions (the served one and the new one)", exc)
                return pull(self.repo, self.dest, **{**kwargs, "keep": 2})
        except ForeignStoreError as exc:
            # Only a checkpoint deltafs pulled from another store is replaced unasked (a host moved to a new run);
            # anything else at DEST (a file, a directory of other files, a link deltafs did not make: often a
            # typo in a unit file) is refused like pull refuses it, and nothing is moved.
            log.warning("%s; replacing it with a full version of %s (the old checkpoint is moved aside)", exc,
                        self.store_url)
            return pull(self.repo, self.dest, force=True, **kwargs)
        except (DestinationError, LocalWriteError):
            raise  # DEST's own problems (exit 9, 12): no other version would fare better
        except (LockHeldError, StoreError, VersionNotFoundError, ForeignManifestError):
            raise
        except DeltafsError as exc:
            raise NothingVerifiableError(f"version {version} cannot be verified: {exc}") from exc

    def _group_versions_in_use(self) -> list[str]:
        """On an engine group's host without the engine's HTTP API (a follower): the version directories the group's
        engine serves or is switching to, as the leader's ledger entry says. The engine's ranks on this host load them
        from this disk: a pull here must neither rewrite (recycle) nor remove them (an adversarial pass had a
        follower's pulls rewrite the version the engine was loading with a newer version's bytes)."""
        if not self.engine_group or self.engine is not None:
            return []
        try:
            members = group_members(self.repo.objects, self.engine_group, store_id=self.status.store_id)
        except (DeltafsError, OSError) as exc:
            log.debug("cannot read the engine group's ledger entries: %s", exc)
            return []
        in_use = {v for m in members if m.engine != "none" for v in (m.served_version, m.staged_version) if v is not None}
        paths = [os.path.realpath(by_version(self.dest, v)) for v in sorted(in_use)]
        return [p for p in paths if os.path.isdir(p)]

    def _group_rollback(self, previous: Target) -> Target | None:
        """The engine group's rollback target: previous at the path that is the same on every host, if every host
        holds it (the rollback sends it to every rank, on every host's own disk), else None with a warning."""
        assert self.engine_group is not None
        path = stable_path(self.dest, int(previous.version), previous.path)
        try:
            ready, _ = ready_hosts(self.repo.objects, self.engine_group, int(previous.version),
                                   store_id=self.status.store_id)
        except (DeltafsError, OSError) as exc:
            log.warning("cannot read engine group %s's ledger entries (%s): if this switch fails, the engine is not sent "
                        "back to version %s", self.engine_group, exc, previous.version)
            return None
        if len(ready | {self.status.host_id}) < self.engine_hosts:
            log.warning("not every host of engine group %s holds version %s: if this switch fails, the engine is not "
                        "sent back to it (SGLang then keeps the weights it had, or reports the failure)",
                        self.engine_group, previous.version)
            return None
        return Target(path, previous.version)

    def _wait_for_group(self, version: int) -> None:
        """Raise GroupNotReadyError until every host of the engine group has the version staged."""
        assert self.engine_group is not None
        ready, members = ready_hosts(self.repo.objects, self.engine_group, version, store_id=self.status.store_id)
        ready.add(self.status.host_id)
        if len(ready) >= self.engine_hosts:
            self.status.group_wait = None
            return
        # Waits for versions served since, by this watcher's switch or any other path, are over.
        served = self.status.served_version
        self._group_since = {v: t for v, t in self._group_since.items() if served is None or v > served}
        self._group_since.setdefault(version, time.monotonic())
        # Since the group first waited for any version not switched to yet: with pushes faster than the hosts take
        # them, each new version would restart the clock and --group-timeout would never report the wait.
        since = min(self._group_since.values())
        waited = time.monotonic() - since  # (taken after `since`: the other order printed "waiting -0s")
        behind = sorted(f"{m.host_id} (has {m.staged_version or m.served_version})" for m in members
                        if m.host_id not in ready)
        missing = self.engine_hosts - len(ready) - len(behind)
        parts = behind + ([f"{missing} host(s) with no live ledger entry"] if missing > 0 else [])
        message = (f"engine group {self.engine_group}: {len(ready)}/{self.engine_hosts} hosts have version {version} "
                   f"staged; waiting {waited:.0f}s for {', '.join(parts)}")
        self.status.group_wait = message
        timed_out = waited >= self.group_timeout
        if timed_out:
            message += f"; not switching until they have it (waited past {self.group_timeout:g}s: check their watchers)"
        else:
            self._set_state("waiting-group")
        raise GroupNotReadyError(message, timed_out=timed_out)

    _rehash = False  # the next pull re-hashes DEST's files (apply found a staged file changed)
    _last_engine_check = 0.0
    _engine_said: str | None = None  # what served_version() answered at the last check (None: not asked since)
    _engine_path_said: str | None = None  # and served_path(), where the engine has one

    def _check_engine(self) -> None:
        """Every heartbeat, ask the engine what it serves. An engine restarted by an operator or a supervisor may
        serve another checkpoint than the version this watcher switched it to, and nothing else would show it until
        the next push: status said "serving 3, LAG 0" for the restarted engine (adversarial pass). A different
        answer makes the watcher learn what it serves again, and switch it to the newest version if that is not it."""
        if self.engine is None or self.served is None or self._unconfirmed:
            return
        if time.monotonic() - self._last_engine_check < self.heartbeat:
            return
        self._last_engine_check = time.monotonic()
        try:
            # And the directory it loaded, where it says (SGLang's model_path): an engine restarted from other weights
            # under the same label changes only that (adversarial pass: served "3" from elsewhere, status healthy).
            reported, path = engine_answer(self.engine)
            # Not while another process switches this engine (a cron run): its load answers in between. Tested
            # after asking, and let go at once: holding the lock over the request would turn that run away.
            with LocalCheckpoint(self.dest).lock(wait=False, name="engine.lock"):
                pass
        except (DeltafsError, OSError) as exc:
            log.debug("not comparing what the engine serves now: %s", exc)
            return
        # Compared with what it said last: an engine that reports no version, or a label of its own ("default",
        # started on a version directory), is not taken for a restarted one at every heartbeat.
        # None says nothing (an engine that reports no version, or no path, or not at this moment): neither a
        # restart nor what to compare the next answer with, so "3 from A", None, "3 from B" is still a change.
        said, path_said = self._engine_said, self._engine_path_said
        if reported is None:
            return
        self._engine_said = reported
        if path is not None:
            self._engine_path_said = path
        if said is None or (reported == said and (path is None or path_said is None or path == path_said)):
            return
        log.warning("the engine now reports weight_version %r from %s, not %r from %s (restarted?); finding out what "
                    "it serves", reported, path, said, path_said)
        self._learn_served()
        if self.served is None:  # not a version of DEST: switch it to the newest again, now
            self.status.served_version = None
            self.poll()

    def _already_serving(self, ahead: Target, staged: Staged) -> None:
        """Another process (a cron `pull --engine`) switched the engine to `ahead`, at least as new as the staged
        version, while it waited: switching now would take the engine back. Nothing is sent."""
        assert self.engine is not None
        log.info("the engine already serves version %s (switched by another process); version %d is not loaded",
                 ahead.version, staged.version)
        self.staged = None
        self.status.staged_version = None
        self._now_serving(ahead)
        self.status.group_wait = None
        record_checksum(self.status, int(ahead.version), loaded_checksum(self.engine))
        self._set_state("serving")

    def _serves_newer(self, version: int) -> Target | None:
        """What the engine serves when it is a verified version of DEST from this store, at least `version` (loading
        that again would be a needless pause), else None (also when it cannot be asked now: the switch finds that out
        itself). current_target tells an old run's directory of the same number from this run's."""
        assert self.engine is not None
        try:
            found = current_target(self.engine, self.dest)
        except EngineError:
            return None
        text = found.version if found is not None else ""
        if found is None or not (text.isascii() and text.isdigit()) or int(text) < version:  # "²".isdigit()
            return None
        try:  # a version directory of this store: one left from a store deleted and made again says nothing
            if read_version_state(found.path)[1].get("store_id") != self.repo.store_id:
                return None
        except (DeltafsError, OSError):
            return None
        return found

    def _now_serving(self, target: Target) -> None:
        """The engine verifiably holds target although the switch reported a failure."""
        self.served = target
        self._engine_said, self._engine_path_said = target.version, None
        self.status.served_version = int(target.version)
        if self.staged is not None and weight_version(self.staged.version) == target.version:
            self.staged = None
            self.status.staged_version = None

    def _metrics(self, *, switches: int = 0, failures: int = 0, pause: float | None = None,
                 sync: float | None = None) -> None:
        """The Prometheus textfile (DELTAFS_METRICS_DIR); never allowed to disturb serving."""
        gauges: dict[str, float] = {}
        if self.status.served_version is not None:
            gauges["deltafs_watch_served_version"] = self.status.served_version
            newest = max(self._noticed, default=self.status.served_version)
            gauges["deltafs_watch_version_lag"] = max(0, newest - self.status.served_version)
        if pause is not None:
            gauges["deltafs_watch_last_pause_seconds"] = pause
        if sync is not None:
            gauges["deltafs_watch_last_sync_seconds"] = sync
        try:
            metrics.record("watch", {"store": self.store_url, "dest": self.dest}, gauges,
                           {"deltafs_watch_switches_total": switches, "deltafs_watch_failures_total": failures})
        except OSError as exc:
            log.warning("cannot write metrics: %s", exc)

    def _recovered(self) -> None:
        """A cycle went through: the host is healthy again, even if there was nothing to switch."""
        if self.status.failures or self.status.state == "degraded":
            log.info("recovered after %d failed sync(s); serving version %s", self.status.failures,
                     self.served.version if self.served else "(unknown)")
            self.status.failures = 0
            self.status.last_error = None
            self._set_state(self._settled_state())

    def _failed(self, exc: BaseException, *, again: bool = True) -> float:
        self.status.failures += 1
        self.status.last_error = short_problem(exc)
        self.status.last_error_at = utcnow()
        self._last_exit = exit_code(exc)
        delay = self._backoff(self.status.failures)
        if again:
            log.error("sync failed (%d in a row; next try in %.1fs): %s", self.status.failures, delay, exc)
        else:
            log.error("sync failed: %s", exc)
        self._set_state("degraded")
        self._metrics(failures=1)
        return delay

    def _backoff(self, failures: int) -> float:
        return backoff(max(0, failures - 1), self.retry_base, self.retry_max, floor=0.5)  # a fleet must not retry in lockstep

    def _set_state(self, state: str) -> None:
        self.status.state = state
        self._write_ledger()

    _last_write = 0.0
    _said_waiting = False

    def _beat(self) -> None:
        """Refresh the ledger entry now and then, so `deltafs status` can tell a live host from a dead one."""
        if time.monotonic() - self._last_write > self.heartbeat:
            self._write_ledger()

    def _write_ledger(self, repo: Repository | None = None) -> None:
        if not self.ledger:
            return
        with self._ledger_lock:  # each write takes the status as it is then: the last write is the newest status
            self._write_ledger_now(repo)

    def _write_ledger_now(self, repo: Repository | None) -> None:
        self._last_write = time.monotonic()
        try:
            objects = (repo if repo is not None else self.repo).objects
            # Never let a ledger write re-create a store directory that was removed or moved.
            if not objects.exists(CONFIG_KEY):
                raise StoreNotFoundError(f"no deltafs store at {self.store_url}")
        except (DeltafsError, OSError) as exc:
            log.debug("no ledger update, the store is unreachable: %s", exc)
            return
        if self.engine_group:
            self.status.held = held_versions(self.dest)
        write_status(objects, self.status)


def _describe_pull(res: PullResult) -> str:
    if not res.updated:
        return "already in DEST"
    how = "from a full version" if res.from_full else f"as a delta from version {res.previous}"
    fallback = " after the delta path failed" if res.fallback else ""
    return f"pulled {how}{fallback} in {res.seconds:.3f}s, {binary_size(res.bytes_read)} read"
