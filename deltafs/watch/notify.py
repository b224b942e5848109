"""Knowing when to look at HEAD: inotify (watchdog) for local stores, polling with jitter otherwise.

Events are only a hint to look now; the watcher always re-reads HEAD, and a slow fallback poll
covers mounts where events never arrive (NFS, FUSE) and dropped events.
"""

from __future__ import annotations

import logging
import random
import threading
from typing import Any

from deltafs.store.base import ObjectStore
from deltafs.store.local import NETWORK_FS as NO_EVENTS_FS  # noqa: F401 - re-exported
from deltafs.store.local import mount_fstype  # noqa: F401 - re-exported for the watcher's callers

log = logging.getLogger("deltafs.watch")


def jittered(seconds: float, spread: float = 0.2) -> float:
    """seconds ± spread, so a fleet started together does not poll the store in lockstep."""
    return max(0.0, seconds * (1.0 + random.uniform(-spread, spread)))


class Notifier:
    """wait(timeout) returns early when the store may have changed."""

    def __init__(self, objects: ObjectStore, *, poll: float | None = None, fallback_poll: float = 30.0) -> None:
        self.objects = objects
        self._changed = threading.Event()
        self._observer: Any = None
        self.mode = "poll"
        self.interval = poll if poll is not None else fallback_poll
        if poll is None and objects.capabilities.file_events:
            self._start_inotify(objects.event_dirs())
        elif poll is None and objects.local_root is not None:
            log.info("%s is on a network filesystem, where file events from other hosts never arrive; polling",
                     objects.local_root)
        if self.mode == "poll" and poll is None:
            self.interval = 5.0  # remote store and no --poll: a sensible default

    def _start_inotify(self, dirs: list[str]) -> None:
        try:
            from watchdog.events import FileSystemEventHandler
            from watchdog.observers import Observer
        except ImportError:  # pragma: no cover - watchdog is a core dependency
            return
        changed = self._changed

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event: Any) -> None:
                changed.set()

        if not dirs:
            return
        observer = Observer()
        try:
            for directory in dirs:  # non-recursive, each: the store says which directories matter
                observer.schedule(Handler(), directory, recursive=False)
            observer.daemon = True
            observer.start()
        except OSError as exc:
            log.info("no file events for %s (%s); polling instead", self.objects.url, exc)
            return
        self._observer = observer
        self.mode = "inotify"

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep until a change event or the (jittered) poll interval; True on an event."""
        limit = jittered(self.interval) if timeout is None else timeout
        hit = self._changed.wait(limit)
        self._changed.clear()
        return hit

    def poke(self) -> None:
        self._changed.set()

    def close(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=2)
            self._observer = None
