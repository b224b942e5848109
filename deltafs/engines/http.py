"""What every HTTP engine adapter shares: one request with one-line errors, a retried resume, and a
switch that never leaves the engine paused.

An adapter subclasses HttpEngine and supplies its routes: `_pause()`, `_resume_once()`, `_load()`
(load a version and check the engine reports it) and `_go_back()` (the rollback after a failed
load). Everything engine-specific (which routes, which bodies, what an answer means, what to say
after a failure) stays in the adapter module.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from deltafs.defaults import DEFAULT_LOAD_TIMEOUT
from deltafs.engines.base import EngineUnreachableError, SwitchError, SwitchResult, Target
from deltafs.errors import EngineError, UsageError, connection_reason


def import_requests(engine: str, extra: str) -> Any:
    """The requests module, or a UsageError naming the extra that installs it."""
    try:
        import requests
    except ImportError:
        raise UsageError(f"the {engine} adapter needs requests: pip install requests (deltafs's [{extra}] extra)") from None
    return requests


@dataclass
class SwitchState:
    """What happened so far in one switch; the adapter fills it in while the engine is paused."""

    failure: EngineError | None = None
    where: str = ""  # appended to the failure: what the engine holds now
    loaded: bool = False  # the target's load was verified
    rolled_back: bool = False
    reached: bool = True  # whether the pause may have reached the engine
    resumable: bool = True  # False once the server died: there is nothing to resume
    paused: bool = False  # resuming failed after the pause reached the engine: it may still be paused
    load_seconds: float = 0.0


class HttpEngine:
    """One engine server reached over HTTP at url; subclasses name the engine and implement its routes."""

    engine_name: ClassVar[str]  # the name in messages: "SGLang", "vLLM"
    extra: ClassVar[str]  # the deltafs extra that installs requests for it
    resume_route: ClassVar[str]  # for the debug log of a failed resume attempt
    resume_final: ClassVar[tuple[type[EngineError], ...]] = ()  # resume errors that retrying cannot fix
    rollback_on: ClassVar[tuple[type[EngineError], ...]] = (EngineError,)  # load failures that send a rollback

    def __init__(self, url: str, *, timeout: float = 10.0, load_timeout: float = DEFAULT_LOAD_TIMEOUT,
                 resume_attempts: int = 4) -> None:
        self._requests = import_requests(self.engine_name, self.extra)
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.load_timeout = load_timeout
        self.resume_attempts = resume_attempts
        self._session = self._requests.Session()

    @property
    def log(self) -> logging.Logger:
        return logging.getLogger(type(self).__module__)  # the adapter's own logger, deltafs.engines.<name>

    # --- HTTP -------------------------------------------------------------------------------
    def _send(self, method: str, route: str, body: dict[str, Any] | None, timeout: float | None,
              params: dict[str, str] | None = None, headers: dict[str, str] | None = None, *,
              fresh: bool = False) -> Any:
        """One request; any transport error becomes a one-line EngineError (EngineUnreachableError: no connection).

        fresh sends it on a new connection instead of the session's kept-alive one.
        """
        url = self.url + route
        sender = self._requests if fresh else self._session
        request = functools.partial(sender.request, method, url, json=body, params=params, headers=headers,
                                    timeout=(self.timeout, timeout))
        try:
            if timeout is None:
                return request()
            # requests' read timeout bounds each wait for a byte, not the answer: a server that sends one byte
            # every few seconds would hold the switch (and a paused engine) forever. The whole exchange gets
            # connect + read timeout; past it the request is left to finish in its thread, on its own session.
            limit = self.timeout + timeout
            done, answer = _within(limit, request)
            if not done:
                if sender is self._session:
                    self._session = self._requests.Session()
                    self._session.headers.update(sender.headers)
                raise EngineError(f"{method} {url} gave no complete answer within {limit:g}s")
            return answer
        except self._requests.Timeout:
            raise EngineError(f"{method} {url} timed out after {timeout:g}s") from None
        except self._requests.ConnectionError as exc:
            raise EngineUnreachableError(f"cannot reach {self.engine_name} at {self.url}: {connection_reason(exc)}") from None
        except self._requests.RequestException as exc:
            raise EngineError(f"{method} {url} failed: {short(exc)}") from None

    # --- what the adapter implements --------------------------------------------------------------
    def _pause(self) -> None:
        raise NotImplementedError

    def _resume_once(self) -> None:
        raise NotImplementedError

    def _load(self, target: Target) -> None:
        """Load target and check that the engine reports it (called while paused)."""
        raise NotImplementedError

    def _go_back(self, previous: Target | None) -> tuple[bool, str]:
        """After a failed load: reload previous (still paused); (whether it is verified back, what to say)."""
        raise NotImplementedError

    def _switch_paused(self, target: Target, previous: Target | None, state: SwitchState) -> None:
        """Load target; after a failure in rollback_on, go back to previous. An adapter may add to this."""
        t_load = time.monotonic()
        try:
            self._load(target)
        except self.rollback_on as exc:
            state.failure = exc
            self.log.error("loading version %s into %s failed: %s", target.version, self.url, exc)
            state.rolled_back, state.where = self._go_back(previous)
            return
        state.loaded = True
        state.load_seconds = time.monotonic() - t_load

    # --- shared protocol methods ------------------------------------------------------------------
    def resume(self, attempts: int | None = None) -> None:
        """Resume generation, retried: a paused engine serves nobody, so try hard."""
        attempts = attempts or self.resume_attempts
        delay = 0.25
        last: EngineError | None = None
        for attempt in range(attempts):
            try:
                self._resume_once()
                return
            except self.resume_final:
                raise
            except EngineError as exc:
                last = exc
                self.log.debug("%s attempt %d failed: %s", self.resume_route, attempt + 1, exc)
                if attempt + 1 < attempts:
                    time.sleep(delay)
                    delay *= 2
        if isinstance(last, EngineUnreachableError):
            raise last  # nothing answers: whether it is paused cannot be known, say what is known
        raise EngineError(f"could not resume generation on {self.url}; the engine may still be paused: {last}")

    def switch(self, target: Target, previous: Target | None) -> SwitchResult:
        """pause -> the adapter's load and checks -> resume; rolled back on failure, never left paused."""
        started = time.monotonic()
        state = SwitchState()
        try:
            try:
                self._pause()
            except EngineUnreachableError:
                state.reached = False
                raise
            self._switch_paused(target, previous, state)
        except EngineError as exc:  # the pause failed; unless unreachable, it may have arrived
            state.failure = exc
        finally:
            # Whatever happened above (KeyboardInterrupt included), never leave the engine paused.
            if state.resumable:
                try:
                    self.resume(None if state.reached else 1)
                except EngineError as exc:
                    if state.reached:
                        self.log.critical("%s", exc)
                        state.paused = True
                    if state.failure is None:
                        state.failure = exc
                        state.where = "; it holds the new version but may still be paused"
        pause_seconds = time.monotonic() - started
        if state.failure is not None:
            raise SwitchError(f"switch to version {target.version} failed: {state.failure}{state.where}",
                              rolled_back=state.rolled_back, previous=previous,
                              serving=target if state.loaded else None, paused=state.paused)
        return SwitchResult(version=target.version, pause_seconds=pause_seconds, load_seconds=state.load_seconds)


def _within(limit: float, fn: Any, *args: Any, **kwargs: Any) -> tuple[bool, Any]:
    """(True, fn(*args, **kwargs)) if it returns within limit seconds (its exception is raised here), else
    (False, None) with the call left running in its daemon thread."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="deltafs-http", daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        return False, None
    if "error" in box:
        raise box["error"]
    return True, box["value"]


def short(exc: BaseException | str) -> str:
    """A message cut to 200 characters, for errors that quote other libraries."""
    text = str(exc)
    return text if len(text) < 200 else text[:200] + "..."


def one_line(text: str) -> str:
    return " ".join(text.split())


def json_body(resp: Any, what: str) -> Any:
    """The response's JSON, or None when the body is not JSON (callers decide what that means). A body nested deeper
    than the parser's recursion limit is an EngineError: it was a RecursionError that ended the watcher (exit 1)."""
    try:
        return resp.json()
    except ValueError:
        return None
    except RecursionError:
        raise EngineError(f"{what} answered a JSON body nested too deeply to be an answer") from None


def error_detail(resp: Any, *keys: str) -> str:
    """The server's error text, in one line: the first of keys in its JSON body, else the raw body or reason.

    A value that is itself an object ({"error": {"message": ...}}) gives its "message".
    """
    try:
        data = resp.json()
    except (ValueError, RecursionError):
        data = None
    detail: Any = None
    if isinstance(data, dict):
        for key in keys:
            detail = data.get(key)
            if detail:
                break
        if isinstance(detail, dict):
            detail = detail.get("message")
    return one_line(str(detail) if detail else (resp.text[:200] or resp.reason))
