"""Knowing when to look at HEAD: inotify (watchdog) for local stores, polling with jitter otherwise.

Events are only a hint to look now; the watcher always re-reads HEAD, and a slow fallback poll
covers mounts where events never arrive (NFS, FUSE) and dropped events.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from typing import Any

from deltafs.store.objects import LocalObjectStore, ObjectStore

log = logging.getLogger("deltafs.watch")


# Filesystems whose changes made on other machines raise no inotify events here.
NO_EVENTS_FS = ("nfs", "cifs", "smb", "fuse", "9p", "ceph", "lustre", "gpfs", "beegfs", "glusterfs", "afs")


def mount_fstype(path: str, mounts: str | None = None) -> str | None:
    """The filesystem type of the mount holding path (from /proc/mounts), or None if unknown."""
    if mounts is None:
        try:
            with open("/proc/mounts") as fh:
                mounts = fh.read()
        except OSError:
            return None
    path = os.path.realpath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)  # the store may not exist yet: judge by its parent
    best, fstype = "", None
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best):
            best, fstype = point, parts[2]
    return fstype


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
        if poll is None and isinstance(objects, LocalObjectStore):
            fstype = mount_fstype(objects.root)
            if fstype is not None and fstype.startswith(NO_EVENTS_FS):
                log.info("%s is on %s, where file events from other hosts never arrive; polling", objects.root, fstype)
            else:
                self._start_inotify()
        if self.mode == "poll" and poll is None:
            self.interval = 5.0  # remote store and no --poll: a sensible default

    def _start_inotify(self) -> None:
        try:
            from watchdog.events import FileSystemEventHandler
            from watchdog.observers import Observer
        except ImportError:  # pragma: no cover - watchdog is a core dependency
            return
        changed = self._changed

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event: Any) -> None:
                changed.set()

        root = self.objects.root
        observer = Observer()
        try:
            # Non-recursive: HEAD is replaced in the root and manifests are created in manifests/;
            # chunks/ would flood us with events during every push.
            observer.schedule(Handler(), root, recursive=False)
            manifests = os.path.join(root, "manifests")
            if os.path.isdir(manifests):
                observer.schedule(Handler(), manifests, recursive=False)
            observer.daemon = True
            observer.start()
        except OSError as exc:
            log.info("no file events for %s (%s); polling instead", root, exc)
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
