"""SGLang adapter over its HTTP API (0.5.x): pause, load from disk, verify the version, continue.

Every field sent here is checked against the request types of a pinned SGLang release by
tests/engines/test_sglang_fields.py, because SGLang ignores unknown JSON fields silently and a
misspelled one would otherwise pass unnoticed.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from deltafs.engines.base import (
    EngineUnreachableError,
    SwitchError,
    SwitchResult,
    Target,
)
from deltafs.errors import EngineError, UsageError

log = logging.getLogger("deltafs.engines.sglang")

PAUSE_MODES = ("abort", "retract", "in_place")

# Routes and bodies, in one place so the field test can read them (see module docstring).
PAUSE_ROUTE = "/pause_generation"
UPDATE_ROUTE = "/update_weights_from_disk"
CONTINUE_ROUTE = "/continue_generation"
MODEL_INFO_ROUTE = "/model_info"
LOADS_ROUTE = "/v1/loads"


def pause_body(mode: str) -> dict[str, Any]:
    return {"mode": mode}


def update_body(target: Target) -> dict[str, Any]:
    # flush_cache: the radix/KV cache holds activations of the old weights; reusing them after the
    # switch would mix versions inside one sequence.
    return {"model_path": target.path, "weight_version": target.version, "flush_cache": True}


def continue_body() -> dict[str, Any]:
    return {}


class SGLangEngine:
    """One SGLang server, reached at url (e.g. http://127.0.0.1:30000)."""

    kind = "sglang"

    def __init__(
        self,
        url: str,
        *,
        pause_mode: str = "retract",
        timeout: float = 10.0,
        load_timeout: float = 900.0,
        api_key: str | None = None,
        resume_attempts: int = 4,
    ) -> None:
        if pause_mode not in PAUSE_MODES:
            raise UsageError(f"unknown pause mode {pause_mode!r}; use one of {', '.join(PAUSE_MODES)}")
        try:
            import requests
        except ImportError:
            raise UsageError("the SGLang adapter needs requests: pip install 'deltafs[sglang]'") from None
        self._requests = requests
        self.url = url.rstrip("/")
        self.pause_mode = pause_mode
        self.timeout = timeout
        self.load_timeout = load_timeout
        self.resume_attempts = resume_attempts
        self._session = requests.Session()
        if api_key:
            self._session.headers["Authorization"] = f"Bearer {api_key}"

    def __repr__(self) -> str:
        return f"SGLangEngine({self.url!r}, pause_mode={self.pause_mode!r})"

    # --- HTTP -------------------------------------------------------------------------------
    def _call(self, method: str, route: str, body: dict[str, Any] | None, timeout: float,
              params: dict[str, str] | None = None) -> Any:
        """One request; any transport error, non-2xx answer or non-JSON body becomes EngineError."""
        url = self.url + route
        try:
            resp = self._session.request(method, url, json=body, params=params, timeout=(self.timeout, timeout))
        except self._requests.Timeout:
            raise EngineError(f"{method} {url} timed out after {timeout:g}s") from None
        except self._requests.ConnectionError as exc:
            raise EngineUnreachableError(f"cannot reach SGLang at {self.url} ({_short(exc)})") from None
        except self._requests.RequestException as exc:
            raise EngineError(f"{method} {url} failed: {_short(exc)}") from None
        try:
            data = resp.json()
        except ValueError:
            data = None
        if not 200 <= resp.status_code < 300:
            detail = (data.get("message") or data.get("detail")) if isinstance(data, dict) else None
            detail = detail or resp.text[:200] or resp.reason
            raise EngineError(f"{method} {route} answered HTTP {resp.status_code}: {detail}")
        if isinstance(data, dict) and data.get("success") is False:
            raise EngineError(f"{method} {route} reported failure: {data.get('message', '')}")
        return data

    # --- Engine protocol -------------------------------------------------------------------
    def served_version(self) -> str | None:
        info = self._call("GET", MODEL_INFO_ROUTE, None, self.timeout)
        if not isinstance(info, dict):
            raise EngineError(f"GET {MODEL_INFO_ROUTE} did not answer a JSON object")
        version = info.get("weight_version")
        return None if version is None else str(version)

    def busy_requests(self) -> int | None:
        """Running plus waiting requests over all DP ranks, from GET /v1/loads?include=core."""
        try:
            data = self._call("GET", LOADS_ROUTE, None, self.timeout, params={"include": "core"})
        except EngineError as exc:
            log.debug("cannot read the load of %s: %s", self.url, exc)
            return None
        loads = data.get("loads") if isinstance(data, dict) else None
        if not isinstance(loads, list):
            return None
        total = 0
        for entry in loads:
            if isinstance(entry, dict):
                total += int(entry.get("num_running_reqs", 0)) + int(entry.get("num_waiting_reqs", 0))
        return total

    def resume(self, attempts: int | None = None) -> None:
        """continue_generation, retried: a paused engine serves nobody, so try hard."""
        attempts = attempts or self.resume_attempts
        delay = 0.25
        last: EngineError | None = None
        for attempt in range(attempts):
            try:
                self._call("POST", CONTINUE_ROUTE, continue_body(), self.timeout)
                return
            except EngineError as exc:
                last = exc
                log.debug("continue_generation attempt %d failed: %s", attempt + 1, exc)
                if attempt + 1 < attempts:
                    time.sleep(delay)
                    delay *= 2
        if isinstance(last, EngineUnreachableError):
            raise last  # nothing answers: whether it is paused cannot be known, say what is known
        raise EngineError(f"could not resume generation on {self.url}; the engine may still be paused: {last}")

    def switch(self, target: Target, previous: Target | None) -> SwitchResult:
        """pause -> update_weights_from_disk -> check /model_info -> continue; rollback on failure.

        The version check runs while still paused so that a wrong load is rolled back before
        any request sees it.
        """
        started = time.monotonic()
        failure: EngineError | None = None
        loaded = rolled_back = False
        reached = True  # whether the pause may have reached the engine
        load_seconds = 0.0
        try:
            try:
                self._call("POST", PAUSE_ROUTE, pause_body(self.pause_mode), self.timeout)
            except EngineUnreachableError:
                reached = False
                raise
            t_load = time.monotonic()
            try:
                self._load(target)
                loaded = True
                load_seconds = time.monotonic() - t_load
            except EngineError as exc:
                failure = exc
                log.error("loading version %s into %s failed: %s", target.version, self.url, exc)
                if previous is not None:
                    rolled_back = self._rollback(previous)
        except EngineError as exc:  # the pause failed; unless unreachable, it may have arrived
            failure = exc
        finally:
            # Whatever happened above (KeyboardInterrupt included), never leave the engine paused.
            try:
                self.resume(None if reached else 1)
            except EngineError as exc:
                if reached:
                    log.critical("%s", exc)
                if failure is None:
                    failure = exc
        pause_seconds = time.monotonic() - started
        if failure is not None:
            where = ("; it holds the new version but may still be paused" if loaded
                     else f"; serving version {previous.version} again" if rolled_back and previous
                     else "; could not confirm the previous version is back" if previous and reached else "")
            raise SwitchError(f"switch to version {target.version} failed: {failure}{where}", rolled_back=rolled_back,
                              previous=previous, serving=target if loaded else None)
        return SwitchResult(version=target.version, pause_seconds=pause_seconds, load_seconds=load_seconds)

    def _load(self, target: Target) -> None:
        self._call("POST", UPDATE_ROUTE, update_body(target), self.load_timeout)
        reported = self.served_version()
        if reported != target.version:
            raise EngineError(f"engine reports weight_version {reported!r} after loading {target.version!r}")

    def _rollback(self, previous: Target) -> bool:
        try:
            self._load(previous)
        except EngineError as exc:
            log.critical("rollback to version %s on %s failed: %s", previous.version, self.url, exc)
            return False
        log.warning("rolled %s back to version %s", self.url, previous.version)
        return True


def _short(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) < 200 else text[:200] + "..."
