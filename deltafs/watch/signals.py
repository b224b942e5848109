"""Signal handlers that hand their work to a thread of its own.

Python runs a signal handler in the main thread, between two bytecodes, possibly while that thread holds a lock:
`threading.Event.wait` re-takes the event's internal lock each time it wakes (on its timeout, every poll), and a
handler that calls `event.set()` there waits for a lock its own thread holds, forever. A watcher stuck that way
ignores SIGTERM until systemd kills it. The handlers here only start a thread that does the work; it takes the
lock once the main thread lets go of it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any


def handler(work: Callable[[], object], name: str = "deltafs-signal") -> Callable[[int, Any], None]:
    """A signal handler that runs work() in a new daemon thread and returns at once."""

    def run(signum: int, frame: Any) -> None:
        threading.Thread(target=work, name=f"{name}-{signal.Signals(signum).name}", daemon=True).start()

    return run
