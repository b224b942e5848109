"""Signal handlers that hand their work to a thread of its own.

Python runs a signal handler in the main thread, between two bytecodes, possibly while that thread holds a lock:
`threading.Event.wait` re-takes the event's internal lock each time it wakes (on its timeout, every poll), and a
handler that calls `event.set()` there waits for a lock its own thread holds, forever. A watcher stuck that way
ignores SIGTERM until systemd kills it. The handlers here only start a thread that does the work; it takes the
lock once the main thread lets go of it.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from deltafs.engines import inflight


def handler(work: Callable[[], object], name: str = "deltafs-signal") -> Callable[[int, Any], None]:
    """A signal handler that runs work() in a new daemon thread and returns at once."""

    def run(signum: int, frame: Any) -> None:
        threading.Thread(target=work, name=f"{name}-{signal.Signals(signum).name}", daemon=True).start()

    return run


_deferred = 0  # the switch (inflight serial) during which finish_switch_first let one signal pass


def finish_switch_first(signum: int, frame: Any) -> None:
    """SIGTERM / SIGINT handler for one-shot commands (`watch --once`, `pull --engine`): end the command at once
    (KeyboardInterrupt: exit 130, a pull's staging is crash-safe) unless an engine switch runs in this process,
    which is let finish, since the engine would be left paused or mid-load. A second signal during the same switch
    interrupts it all the same (its own cleanup still resumes the engine, and the switch record stays for the next
    process); a later switch again lets one signal pass."""
    global _deferred
    switch = inflight.in_switch()
    if switch and switch != _deferred:
        _deferred = switch
        # No logging here: a handler runs between two bytecodes and must not wait for a lock (see above).
        os.write(2, f"deltafs: {signal.Signals(signum).name} during an engine switch: finishing the switch first "
                    "(send it again to interrupt)\n".encode())
        return
    raise KeyboardInterrupt


def install_finish_switch_first() -> None:
    """finish_switch_first for SIGTERM, SIGINT and SIGHUP (in the main thread). SIGHUP comes when the ssh or tmux
    session a command was started from goes away; by default it killed the command mid-switch."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, finish_switch_first)


def warn_and_ignore(sig: signal.Signals, why: str) -> None:
    """Ignore sig (in the main thread), writing one line to stderr each time it comes."""
    line = f"deltafs: {sig.name} ignored: {why}\n".encode()

    def run(signum: int, frame: Any) -> None:
        os.write(2, line)  # no logging in a handler (see above)

    signal.signal(sig, run)
