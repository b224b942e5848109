"""SGLang adapter over its HTTP API (0.5.x): pause, load from disk, verify the version, continue.

Every field sent here is checked against the request types of the pinned SGLang release by
tests/engines/test_sglang_fields.py, because SGLang ignores unknown JSON fields silently and a
misspelled one would otherwise pass unnoticed; tests/engines/test_sglang_wheel.py runs this adapter
against SGLang's own endpoint and update code taken from that release.

Three facts of SGLang 0.5.23 shape the switch:
  - While generation is paused, update_weights_from_disk skips SGLang's update lock and every update
    shares one result slot: a second update while one may still run gets the first one's answer and
    crashes the server. So at most one update is ever in flight per engine: a slow load is waited
    out by polling /model_info up to a deadline, and a rollback is sent only after SGLang answered.
  - With pause mode in_place the running requests stay in the batch, and SGLang refuses a cache
    flush after it has already swapped the weights; in_place therefore loads without flush_cache.
  - pause/update/continue/weights_checker are admin endpoints (--admin-api-key when the server has
    one, else --api-key); /model_info and /v1/loads take the ordinary --api-key.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from deltafs.defaults import DEFAULT_LOAD_TIMEOUT
from deltafs.engines.base import EngineUnreachableError, SwitchError, SwitchResult, Target
from deltafs.engines.http import HttpEngine, SwitchState, error_detail, json_body, one_line, short
from deltafs.engines.versions import reported_version
from deltafs.errors import EngineError, UsageError

log = logging.getLogger("deltafs.engines.sglang")

PAUSE_MODES = ("abort", "retract", "in_place")
API_KEY_ENV = "DELTAFS_ENGINE_API_KEY"
ADMIN_API_KEY_ENV = "DELTAFS_ENGINE_ADMIN_API_KEY"

# Routes and bodies, in one place so the field test can read them (see module docstring).
PAUSE_ROUTE = "/pause_generation"
UPDATE_ROUTE = "/update_weights_from_disk"
CONTINUE_ROUTE = "/continue_generation"
MODEL_INFO_ROUTE = "/model_info"
LOADS_ROUTE = "/v1/loads"
CHECKSUM_ROUTE = "/weights_checker"
ADMIN_ROUTES = (PAUSE_ROUTE, UPDATE_ROUTE, CONTINUE_ROUTE, CHECKSUM_ROUTE)


def pause_body(mode: str) -> dict[str, Any]:
    return {"mode": mode}


def update_body(target: Target, *, flush_cache: bool = True) -> dict[str, Any]:
    # flush_cache: the radix/KV cache holds activations of the old weights; reusing them after the
    # switch would mix versions inside one sequence. Not with in_place (see the module docstring).
    return {"model_path": target.path, "weight_version": target.version, "flush_cache": flush_cache}


def continue_body() -> dict[str, Any]:
    return {}


def checksum_body() -> dict[str, Any]:
    return {"action": "checksum"}


def launch_args(dest: str, version: int) -> list[str]:
    """The SGLang arguments that start a replica at the version DEST holds, so the watcher knows it."""
    return ["--model-path", dest, "--weight-version", str(int(version))]


class EngineAuthError(EngineError):
    """SGLang refused the key (HTTP 401/403); the message names the variable to set."""


class EngineDiedError(EngineError):
    """The server went away (or restarted) while a switch was in progress."""


class _Refused(EngineError):
    """SGLang answered the update and did not load it: a rollback may be sent now."""


class _Unanswered(EngineError):
    """The update was not answered by the deadline: it may still run, nothing else may be sent."""


class _Unconfirmed(EngineError):
    """The update answered success, but reading what the engine serves failed: it likely holds the new version."""


class SGLangEngine(HttpEngine):
    """One SGLang server, reached at url (e.g. http://127.0.0.1:30000)."""

    kind = "sglang"
    loads_from_disk = True  # update_weights_from_disk re-reads the checkpoint: switch_engine warms the page cache
    engine_name = "SGLang"
    extra = "sglang"
    resume_route = "continue_generation"
    resume_final = (EngineAuthError,)
    rollback_on = (_Refused,)  # SGLang answered and did not load it; other failures send nothing more

    def __init__(
        self,
        url: str,
        *,
        pause_mode: str = "retract",
        timeout: float = 10.0,
        load_timeout: float = DEFAULT_LOAD_TIMEOUT,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        resume_attempts: int = 4,
        poll_interval: float = 1.0,
        verify_reads: int = 4,
    ) -> None:
        if pause_mode not in PAUSE_MODES:
            raise UsageError(f"unknown pause mode {pause_mode!r}; use one of {', '.join(PAUSE_MODES)}")
        super().__init__(url, timeout=timeout, load_timeout=load_timeout, resume_attempts=resume_attempts)
        self.pause_mode = pause_mode
        self.poll_interval = poll_interval
        self.verify_reads = verify_reads
        self.api_key = api_key or None
        self.admin_api_key = admin_api_key or None
        # The last update sent and its answer box, kept until the answer has been looked at.
        self._inflight: tuple[threading.Thread, Target, float, dict[str, Any]] | None = None

    def __repr__(self) -> str:
        return f"SGLangEngine({self.url!r}, pause_mode={self.pause_mode!r})"

    # --- HTTP -------------------------------------------------------------------------------
    def _headers(self, route: str, fresh: bool = False) -> dict[str, str]:
        key = (self.admin_api_key or self.api_key) if route in ADMIN_ROUTES else self.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if fresh:  # a new connection: with --tokenizer-worker-num > 1 it may reach another worker
            headers["Connection"] = "close"
        return headers

    def _call(self, method: str, route: str, body: dict[str, Any] | None, timeout: float | None,
              params: dict[str, str] | None = None, *, fresh: bool = False) -> Any:
        """One request; any transport error, non-2xx answer or non-JSON body becomes EngineError."""
        resp = self._send(method, route, body, timeout, params, self._headers(route, fresh), fresh=fresh)
        return self._answer(method, route, resp)

    def _answer(self, method: str, route: str, resp: Any) -> Any:
        if resp.status_code in (401, 403):
            raise EngineAuthError(self._auth_message(method, route, resp.status_code))
        if not 200 <= resp.status_code < 300:
            detail = error_detail(resp, "message", "detail")
            raise EngineError(f"{method} {route} answered HTTP {resp.status_code}: {detail}")
        data = json_body(resp, f"{method} {route}")
        if isinstance(data, dict) and data.get("success") is False:
            raise EngineError(f"{method} {route} reported failure: {one_line(str(data.get('message', '')))}")
        return data

    def _auth_message(self, method: str, route: str, status: int) -> str:
        where = f"SGLang at {self.url} refused {method} {route} (HTTP {status})"
        if route in ADMIN_ROUTES:
            if status == 403:
                return f"{where}: the server forbids it without --admin-api-key; start SGLang with one and set {ADMIN_API_KEY_ENV}"
            if self.admin_api_key:
                return f"{where}: {ADMIN_API_KEY_ENV} does not match the server's --admin-api-key"
            if self.api_key:
                return (f"{where}: {API_KEY_ENV} was sent; a server started with --admin-api-key needs "
                        f"{ADMIN_API_KEY_ENV} for pause/update/continue")
            return f"{where}: set {ADMIN_API_KEY_ENV} (its --admin-api-key) or {API_KEY_ENV} (its --api-key)"
        if self.api_key:
            return f"{where}: {API_KEY_ENV} does not match the server's --api-key"
        return f"{where}: the server has --api-key; set {API_KEY_ENV}"

    # --- Engine protocol -------------------------------------------------------------------
    def model_info(self, *, fresh: bool = False) -> dict[str, Any]:
        info = self._call("GET", MODEL_INFO_ROUTE, None, self.timeout, fresh=fresh)
        if not isinstance(info, dict):
            raise EngineError(f"GET {MODEL_INFO_ROUTE} did not answer a JSON object")
        return info

    def served_version(self) -> str | None:
        return reported_version(self.model_info())

    def served_path(self) -> str | None:
        """The model_path SGLang last loaded (its launch path until an update succeeds)."""
        path = self.model_info().get("model_path")
        return str(path) if path else None

    def busy_requests(self) -> int | None:
        """Running plus waiting requests over all DP ranks, from GET /v1/loads?include=core.

        Raises EngineError when the load cannot be read: an error is never "idle".
        """
        data = self._call("GET", LOADS_ROUTE, None, self.timeout, params={"include": "core"})
        loads = data.get("loads") if isinstance(data, dict) else None
        if not isinstance(loads, list):
            raise EngineError(f"GET {LOADS_ROUTE} answered no 'loads' list")
        total = 0
        for entry in loads:
            if isinstance(entry, dict):
                for key in ("num_running_reqs", "num_waiting_reqs"):
                    count = entry.get(key, 0)
                    if type(count) is not int or count < 0:  # a load that cannot be read is never "idle"
                        raise EngineError(f"GET {LOADS_ROUTE} answered {key} {short(repr(count))}, not a count")
                    total += count
        return total

    def loaded_checksum(self) -> str | None:
        """SGLang's checksum over the weights loaded on every rank (/weights_checker); None where absent."""
        try:
            data = self._call("POST", CHECKSUM_ROUTE, checksum_body(), self.load_timeout)
        except EngineAuthError:
            raise
        except EngineError as exc:
            log.info("no loaded-weight checksum from %s: %s", self.url, exc)
            return None
        value = data.get("per_engine_checksum") if isinstance(data, dict) else None
        return str(value) if value else None

    # --- the switch ------------------------------------------------------------------------
    def _pause(self) -> None:
        self._call("POST", PAUSE_ROUTE, pause_body(self.pause_mode), self.timeout)

    def _resume_once(self) -> None:
        self._call("POST", CONTINUE_ROUTE, continue_body(), self.timeout)

    def switch(self, target: Target, previous: Target | None) -> SwitchResult:
        """pause -> update_weights_from_disk -> check /model_info -> continue; rollback on failure.

        The version check runs while still paused so that a wrong load is rolled back before any
        request sees it. Never sends an update while an earlier one may still be running.
        """
        late = self._refuse_if_update_in_flight(target)
        if late is not None:
            return late
        return super().switch(target, previous)

    def _switch_paused(self, target: Target, previous: Target | None, state: SwitchState) -> None:
        try:
            super()._switch_paused(target, previous, state)  # rolls back after _Refused only
        except _Unanswered as exc:
            state.failure = exc
            state.where = ("; no rollback was sent because the load may still be running (a second update "
                           "breaks SGLang); the next try first checks what it serves")
        except _Unconfirmed as exc:
            state.failure = exc
            state.where = ("; no rollback was sent (it most likely holds the new version); the next try first asks "
                           "what it serves")
        except EngineDiedError as exc:
            state.failure, state.resumable = exc, False

    def _go_back(self, previous: Target | None) -> tuple[bool, str]:
        if previous is None:
            return False, "; no previous version to roll back to"
        return self._rollback(previous)

    # --- the one update in flight ----------------------------------------------------------------
    def _refuse_if_update_in_flight(self, target: Target) -> SwitchResult | None:
        """Refuse while an earlier update is unanswered; adopt its late success if it was for target."""
        if self._inflight is None:
            return None
        thread, sent, at, box = self._inflight
        if thread.is_alive():
            raise SwitchError(f"switch to version {target.version} not started: the update to version {sent.version} "
                              f"sent {time.monotonic() - at:.0f}s ago is still unanswered by {self.url}; "
                              "SGLang must answer it (or be restarted) before another update is sent",
                              rolled_back=False, previous=None)
        self._inflight = None
        resp = box.get("resp")
        if sent == target and resp is not None and resp.status_code == 200:
            try:
                self._answer("POST", UPDATE_ROUTE, resp)
                self._confirm(target)
            except EngineError:
                return None
            log.info("%s answered the update to version %s late, with success; nothing to reload", self.url, target.version)
            return SwitchResult(version=target.version, pause_seconds=0.0, load_seconds=0.0)
        return None

    def _load(self, target: Target) -> None:
        """Send one update and wait for SGLang's answer, polling /model_info, up to load_timeout."""
        box: dict[str, Any] = {}
        body = update_body(target, flush_cache=self.pause_mode != "in_place")

        def post() -> None:
            try:
                box["resp"] = self._requests.post(self.url + UPDATE_ROUTE, json=body, headers=self._headers(UPDATE_ROUTE),
                                                  timeout=(self.timeout, None))
            except BaseException as exc:
                box["error"] = exc

        thread = threading.Thread(target=post, name="deltafs-sglang-update", daemon=True)
        self._inflight = (thread, target, time.monotonic(), box)
        thread.start()
        deadline = time.monotonic() + self.load_timeout
        unreachable = 0
        while True:
            thread.join(min(self.poll_interval, max(0.0, deadline - time.monotonic())))
            if not thread.is_alive():
                break
            if time.monotonic() >= deadline:
                raise _Unanswered(f"{UPDATE_ROUTE} got no answer within {self.load_timeout:g}s")
            try:  # still loading: is the server alive, and did the load land already?
                info = self.model_info(fresh=True)
                unreachable = 0
                if reported_version(info) == target.version and info.get("model_path") == target.path:
                    log.info("%s reports version %s loaded before answering the update", self.url, target.version)
            except EngineUnreachableError:
                unreachable += 1
                if unreachable >= 2:
                    thread.join(self.timeout)
                    if thread.is_alive():
                        raise EngineDiedError(f"SGLang at {self.url} stopped answering during the load of version "
                                              f"{target.version}; restart it (it will serve its launch checkpoint)") from None
                    break
            except EngineError:
                pass
        self._inflight = None
        if "error" in box:
            self._lost_during_load(target, box["error"])
        try:
            self._answer("POST", UPDATE_ROUTE, box["resp"])
        except EngineAuthError:
            raise
        except EngineError as exc:
            raise _Refused(str(exc)) from None
        try:
            self._confirm(target)
        except (_Refused, EngineDiedError, EngineAuthError):
            raise
        except EngineError as exc:
            raise _Unconfirmed(f"SGLang answered the update to version {target.version} with success, but what it "
                               f"serves could not be read: {exc}") from None

    def _lost_during_load(self, target: Target, error: BaseException) -> None:
        """The update's connection failed: the server died or restarted. Say which."""
        if not isinstance(error, self._requests.RequestException):
            raise error
        info = None
        deadline = time.monotonic() + min(self.timeout, 5.0)  # a supervisor may be bringing it back
        while info is None:
            try:
                info = self.model_info(fresh=True)
            except EngineError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.25)
        if info is None:
            raise EngineDiedError(f"SGLang at {self.url} died during the load of version {target.version} "
                                  f"({short(error)}); restart it (it will serve its launch checkpoint)") from None
        raise EngineDiedError(f"SGLang at {self.url} restarted during the load of version {target.version}; "
                              f"it now serves weight_version {info.get('weight_version')!r} from {info.get('model_path')}")

    def _confirm(self, target: Target) -> None:
        """The update answered success: /model_info must report the version on some worker.

        Each read is a new connection, because with --tokenizer-worker-num > 1 weight_version is kept
        per worker process and only the worker that took the update knows it.
        """
        seen: list[str] = []
        for _ in range(self.verify_reads):
            try:
                info = self.model_info(fresh=True)
            except EngineUnreachableError as exc:
                raise EngineDiedError(f"SGLang at {self.url} went away right after loading version "
                                      f"{target.version}: {exc}") from None
            reported = reported_version(info)
            if reported == target.version:
                return
            seen.append(repr(reported))
        raise _Refused(f"engine reports weight_version {', '.join(sorted(set(seen)))} after loading {target.version!r}")

    def _rollback(self, previous: Target) -> tuple[bool, str]:
        try:
            self._load(previous)
        except _Unanswered as exc:
            return False, f"; rollback to version {previous.version} unanswered: {exc}"
        except EngineError as exc:
            log.critical("rollback to version %s on %s failed: %s", previous.version, self.url, exc)
            return False, f"; rollback to version {previous.version} failed: {exc}"
        log.warning("rolled %s back to version %s", self.url, previous.version)
        return True, f"; serving version {previous.version} again"
