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
import stat
import threading
import time
from collections.abc import Iterator
from typing import Any

from deltafs.engines.base import Engine, EngineUnreachableError, Target
from deltafs.defaults import DEFAULT_LOAD_TIMEOUT
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
    """Whether a deltafs process with this pid runs on this host (the record's writer: a pid reused by another
    program is not it)."""
    if type(pid) is not int or pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return b"deltafs" in fh.read(65536)
    except OSError:  # gone, or no /proc: said as stopped, which only changes a log line
        return False


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

    def clear(self, only: dict[str, Any] | None = None) -> None:
        """Remove the record; with only, just if it is still that one (not a newer switch's)."""
        if only is not None and self.read() != only:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def read(self) -> dict[str, Any] | None:
        """The record, or None when there is none. One that is there but cannot be read (damaged, cut short, another
        format) is a switch that may still be loading all the same: its version is unknown ("?") and its deadline
        the file's mtime plus the longest load a deltafs switch allows by default, plus 60 s (it was taken for no
        record, and the engine resumed mid-load: adversarial pass). A planted symlink counts as none."""
        record = self.local.switch_record()
        if record is not None:
            return record
        try:
            st = os.lstat(self.path)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        return {"version": "?", "deadline": st.st_mtime + DEFAULT_LOAD_TIMEOUT + 60, "unreadable": True}

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
        the load's time is up, the load may still run. Wait for it, then drop the record and return True. A record
        that goes away meanwhile was cleared by its own process, which finished the switch; a record replaced by
        another is another switch, waited for in turn (its process may be killed mid-load too: adversarial pass).
        When stop ends the wait first, return False and keep the record: the load may still run, so the caller must
        neither resume the engine nor send it anything, and the next process waits for it in turn."""
        stop = stop if stop is not None else threading.Event()
        record = self.read()
        while record is not None:
            try:
                version, deadline = str(record["version"]), float(record["deadline"])
            except (ValueError, KeyError, TypeError):
                version, deadline = "?", 0.0  # not a deltafs record: nothing to wait for
            if time.time() < deadline:
                who = (f"deltafs process {record.get('pid')}, still running" if _alive(record.get("pid"))
                       else "a deltafs process that stopped")
                what = "an unreadable switch record" if record.get("unreadable") else f"a switch to version {version}"
                log.warning("%s (%s) may still be loading; waiting for the engine to report it, or for that process "
                            "to finish it (up to %.0fs)", what, who, deadline - time.time())
            while time.time() < deadline:
                if stop.is_set():
                    return False
                now = self.read()
                if now != record:
                    break  # gone (its process finished the switch), or another switch: waited for in turn
                try:
                    if engine.served_version() == version:
                        break
                except EngineUnreachableError:
                    break  # nothing answers there: no load of ours is running
                except EngineError as exc:
                    # A timeout or an error answer: busy, maybe loading. It ended the wait, and the engine was
                    # resumed mid-load (docs audit).
                    log.debug("the engine did not say what it serves (%s); still waiting", exc)
                stop.wait(1.0)
            else:
                now = record  # the deadline passed
            if now is record or now == record:
                self.clear(only=record)  # done with this one (not a newer switch's that replaced it meanwhile)
                now = self.read()
                if now == record:  # it cannot be removed: nothing more to wait for (its time is up, or it loaded)
                    return True
            record = now
        return True

    def pending(self) -> dict[str, Any] | None:
        """The record of a switch that may still be loading (its deadline not passed), else None."""
        record = self.read()
        try:
            return record if record is not None and time.time() < float(record["deadline"]) else None
        except (ValueError, KeyError, TypeError):
            return None
