"""Task boundaries: when a staged version may be switched in.

    immediate  switch as soon as the version is staged
    idle       wait until the engine has no running or queued requests (at most max_wait seconds)
    signal     wait until the orchestrator says so: it touches a file, sends SIGUSR1, or POSTs to
               http://127.0.0.1:PORT/boundary

Only signals that arrive while a staged version waits count: an old "boundary now" must not
trigger a switch in the middle of a later task.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from deltafs.defaults import DEFAULT_MAX_WAIT
from deltafs.engines.base import Engine
from deltafs.errors import EngineError, UsageError
from deltafs.watch import signals

log = logging.getLogger("deltafs.watch")


BOUNDARY_KINDS = ("immediate", "idle", "signal")


class Boundary(Protocol):
    name: str

    def wait(self, engine: Engine | None, stop: threading.Event) -> bool:
        """Block until a switch may happen; False if stop was set first."""
        ...

    def close(self) -> None:
        ...


class Immediate:
    name = "immediate"

    def wait(self, engine: Engine | None, stop: threading.Event) -> bool:
        return not stop.is_set()

    def close(self) -> None:
        pass


class Idle:
    """Wait for zero busy requests, checked every `interval` seconds, for at most max_wait.

    An engine whose load cannot be read (401, 404, connection refused) is not idle: the boundary
    keeps asking, and after max_wait raises EngineError so the switch is retried later, never forced.
    """

    name = "idle"

    def __init__(self, max_wait: float = DEFAULT_MAX_WAIT, interval: float = 0.2) -> None:
        self.max_wait = max_wait
        self.interval = interval

    def wait(self, engine: Engine | None, stop: threading.Event) -> bool:
        if engine is None:
            return not stop.is_set()
        deadline = time.monotonic() + self.max_wait
        last_error: EngineError | None = None
        while not stop.is_set():
            try:
                busy = engine.busy_requests()
            except EngineError as exc:
                if last_error is None:
                    log.warning("cannot read the engine's load (%s); not switching until it can be read", exc)
                last_error = exc
                if time.monotonic() >= deadline:
                    raise EngineError(f"idle boundary: the engine's load could not be read for {self.max_wait:g}s, "
                                      f"so the switch waits: {exc}") from None
                stop.wait(self.interval)
                continue
            if busy is None:
                log.warning("engine %s has no notion of load; switching without waiting for idle", engine.kind)
                return True
            if busy == 0:
                return True
            if time.monotonic() >= deadline:
                log.warning("engine still has %d request(s) after %gs; switching anyway (max wait reached)", busy, self.max_wait)
                return True
            stop.wait(self.interval)
        return False

    def close(self) -> None:
        pass


class Signal:
    """The orchestrator decides: a touched file, SIGUSR1, or POST /boundary on a local port."""

    name = "signal"

    def __init__(self, *, file: str | None = None, sigusr1: bool = True, port: int | None = None,
                 interval: float = 0.1) -> None:
        self.file = os.path.abspath(file) if file else None
        self.interval = interval
        self._event = threading.Event()
        self._file_mark = self._mtime()
        self._httpd: ThreadingHTTPServer | None = None
        self._old_handler: Any = None
        if sigusr1:
            if threading.current_thread() is not threading.main_thread():
                raise UsageError("the SIGUSR1 boundary must be set up from the main thread")
            self._old_handler = signal.signal(signal.SIGUSR1, signals.handler(self._event.set, "deltafs-boundary"))
        if port is not None:
            self._httpd = _serve(self, port)

    @property
    def port(self) -> int | None:
        return self._httpd.server_address[1] if self._httpd else None

    def trigger(self) -> None:
        """Say "boundary now" from Python (what the file, the signal and the endpoint do)."""
        self._event.set()

    def _mtime(self) -> float | None:
        try:
            return os.stat(self.file).st_mtime_ns if self.file else None
        except FileNotFoundError:
            return None

    def wait(self, engine: Engine | None, stop: threading.Event) -> bool:
        self._event.clear()  # forget signals from before this version was staged
        self._file_mark = self._mtime()
        while not stop.is_set():
            if self._event.wait(self.interval):
                return True
            mark = self._mtime()
            if mark is not None and mark != self._file_mark:
                return True
        return False

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._old_handler is not None:
            signal.signal(signal.SIGUSR1, self._old_handler)
            self._old_handler = None


def _serve(boundary: Signal, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            if self.path.split("?", 1)[0] != "/boundary":
                self.send_error(404)
                return
            boundary.trigger()
            body = json.dumps({"status": "ok"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    # Loopback only: anyone who can reach the port can make the engine switch now.
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:  # 0: any free port (tests)
        raise UsageError(f"--boundary-port must be a port number, 1..65535, not {port!r}")
    try:
        httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    except OSError as exc:  # in use (another watcher's?): a unit file restarting on failure would loop on it
        raise UsageError(f"--boundary-port {port}: cannot listen on 127.0.0.1:{port}: {exc.strerror or exc}") from None
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="deltafs-boundary", daemon=True).start()
    return httpd


def make_boundary(kind: str, *, max_wait: float = DEFAULT_MAX_WAIT, file: str | None = None, port: int | None = None,
                  sigusr1: bool = True) -> Boundary:
    if kind == "immediate":
        return Immediate()
    if kind == "idle":
        return Idle(max_wait=max_wait)
    if kind == "signal":
        return Signal(file=file, sigusr1=sigusr1, port=port)
    raise UsageError(f"unknown boundary {kind!r}; use one of {', '.join(BOUNDARY_KINDS)}")
