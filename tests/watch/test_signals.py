"""Signal handlers never wait for a lock their own (main) thread may hold (deltafs.watch.signals)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# The main thread holds the event's internal lock, as threading.Event.wait does for a moment each time it wakes
# (every poll of the watcher's loop), when the signal arrives: the handler runs right there, before the release.
RACE = r"""
import os, signal, threading
from deltafs.watch.signals import handler
event = threading.Event()
signal.signal(signal.SIGTERM, {install})
event._cond.acquire()
os.kill(os.getpid(), signal.SIGTERM)
event._cond.release()
assert event.wait(10), "the handler's work never ran"
print("stopped")
"""


def test_a_signal_that_lands_while_the_main_thread_holds_the_lock_still_sets_the_event() -> None:
    proc = subprocess.run([sys.executable, "-c", RACE.format(install='handler(event.set)')], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "stopped\n", proc.stderr


def test_the_race_is_real_for_a_handler_that_sets_the_event_itself() -> None:
    """What the handlers avoid: the plain `lambda *_: event.set()` hangs the process in the same spot."""
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", RACE.format(install="lambda *_: event.set()")], capture_output=True,
                       timeout=5)
