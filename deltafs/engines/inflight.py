"""A switch in flight: the record a switch leaves beside DEST, and the process's own "switching now" mark.

An engine in another process (SGLang, vLLM) keeps loading when the deltafs process that asked for the load is
killed. The switch therefore leaves DEST.deltafs/engine-switch.json while it runs (the version, the path and when
the load's time is up); whoever switches that engine next, a restarted watcher or a cron `pull --engine`, waits for
that load first (SwitchRecord.wait_for_killed), because a resume or a second update mid-load breaks the engine.

switching() marks this process as inside a switch, so that signal handlers of one-shot commands can let it finish
(a SIGTERM from `timeout` or systemd must not leave the engine paused): deltafs.watch.signals.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from deltafs.engines.base import Engine, EngineUnreachableError, Target
from deltafs.errors import EngineError
from deltafs.read.dest import SWITCH_RECORD, LocalCheckpoint, atomic_write

log = logging.getLogger("deltafs.engines")

_switches = 0  # switches running in this process (the watcher runs one at a time; a program may run several)
_serial = 0  # switches started in this process: a signal handler tells one switch from the next by it
_count_lock = threading.Lock()


@contextlib.contextmanager
def switching() -> Iterator[None]:
    """Mark this process as switching an engine for the duration (see in_switch)."""
    global _switches, _serial
    with _count_lock:
        _switches += 1
        _serial += 1
    try:
        yield
    finally:
        with _count_lock:
            _switches -= 1


def in_switch() -> int:
    """The serial number of the newest switch if one runs in this process now, else 0 (read by signal handlers:
    no lock taken)."""
    return _serial if _switches > 0 else 0


def _alive(pid: Any) -> bool:
    """Whether a process with this pid runs on this host (the record's writer, if not reused since)."""
    if type(pid) is not int or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists, owned by someone else
    return True


class SwitchRecord:
    """DEST.deltafs/engine-switch.json: the version a switch asked the engine to load, while it runs."""

    def __init__(self, dest: str) -> None:
        self.local = LocalCheckpoint(dest)
        self.path = os.path.join(self.local.sidecar, SWITCH_RECORD)

    def write(self, engine: Engine, target: Target) -> None:
        """Leave the record (best effort: a DEST disk full to the last byte still switches). Only for an engine in
        another process (one with a url), whose load outlives ours."""
        if getattr(engine, "url", None) is None:
            return
        load = float(getattr(engine, "load_timeout", 0) or 0)
        record = {"version": target.version, "path": target.path, "pid": os.getpid(), "deadline": time.time() + load + 60}
        try:
            atomic_write(self.path, json.dumps(record).encode())
        except OSError as exc:
            log.warning("cannot record the switch in %s: %s", self.path, exc)

    def clear(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    @contextlib.contextmanager
    def around(self, engine: Engine, target: Target) -> Iterator[None]:
        """The record for the duration of one switch, marked as switching() too."""
        with switching():
            self.write(engine, target)
            try:
                yield
            except Exception:
                self.clear()  # the switch failed and said so: its load is over (or was never sent)
                raise
            # An interrupt (KeyboardInterrupt) may have left the load running: the record stays for the next
            # process, which waits for the load or for the record's deadline.
            self.clear()

    def wait_for_killed(self, engine: Engine, stop: threading.Event | None = None) -> bool:
        """A switch whose process was killed mid-load left its record: until the engine reports that version, or
        the load's time is up, the load may still run. Wait for it, then drop the record and return True. When stop
        ends the wait first, return False and keep the record: the load may still run, so the caller must neither
        resume the engine nor send it anything (a watcher stopped during the wait resumed it mid-load, adversarial
        pass), and the next process waits for it in turn."""
        record = self.local.switch_record()
        if record is None:
            return True
        try:
            version, deadline = str(record["version"]), float(record["deadline"])
        except (ValueError, KeyError, TypeError):
            return True
        if time.time() < deadline:
            who = ("deltafs process %s, still running" % record.get("pid") if _alive(record.get("pid"))
                   else "a deltafs process that stopped")
            log.warning("a switch to version %s by %s may still be loading; waiting for the engine to report it, or "
                        "for that process to finish it (up to %.0fs)", version, who, deadline - time.time())
        stop = stop if stop is not None else threading.Event()
        while time.time() < deadline:
            if stop.is_set():
                return False
            if self.local.switch_record() != record:
                # Its process finished the switch (and cleared the record), or another switch began: that one's
                # process owns the engine now. A watcher started beside a cron run waited out the cron's whole
                # deadline after the cron had rolled back and resumed (adversarial pass).
                return True
            try:
                if engine.served_version() == version:
                    break
            except EngineUnreachableError:
                break  # nothing answers there: no load of ours is running
            except EngineError as exc:
                # A timeout or an error answer: busy, maybe loading. It ended the wait, and the engine was resumed
                # mid-load (docs audit).
                log.debug("the engine did not say what it serves (%s); still waiting", exc)
            stop.wait(1.0)
        self.clear()
        return True

    def pending(self) -> dict[str, Any] | None:
        """The record of a switch that may still be loading (its deadline not passed), else None."""
        record = self.local.switch_record()
        try:
            return record if record is not None and time.time() < float(record["deadline"]) else None
        except (ValueError, KeyError, TypeError):
            return None
