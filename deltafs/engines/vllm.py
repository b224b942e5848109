"""vLLM adapter over its OpenAI server's development routes (0.33): pause, reload from disk, label, resume.

vLLM 0.33 has no "update weights from disk" route; it reloads in place through a worker method:
POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}} re-reads the
checkpoint at DIR with the server's own loader on every worker. Around it: POST /pause?mode=...
(query parameters, not a body), POST /resume, and the weight version label (POST
/update_weight_version, GET /weight_info; "default" until someone sets it). These routes exist only
when the server runs with VLLM_SERVER_DEV_MODE=1, and vLLM's --api-key does not guard them (it
guards /v1/... only): keep the port private.

vLLM never ties the label to the weights: reload_weights leaves it alone. So the adapter sets it,
and while a reload runs it sets "deltafs-loading:<version>", because an in-place reload that fails
half way leaves a mix of versions that no label should name. Every field sent here is checked
against the pinned release's source by tests/engines/test_vllm_source.py.
"""

from __future__ import annotations

import logging
from typing import Any

from deltafs.defaults import DEFAULT_LOAD_TIMEOUT
from deltafs.engines.base import EngineUnreachableError, Target
from deltafs.engines.http import HttpEngine, SwitchState, error_detail, json_body, short
from deltafs.engines.versions import reported_version
from deltafs.errors import EngineError, UsageError

log = logging.getLogger("deltafs.engines.vllm")

# vLLM's PauseMode. "retract" is the SGLang name of what "keep" does here (running requests are
# preempted and recomputed after the switch, none fails), so the CLI's shared default works for both.
PAUSE_MODES = ("abort", "wait", "keep")
PAUSE_ALIASES = {"retract": "keep"}

# Routes and bodies, in one place so the source test can read them (see module docstring).
PAUSE_ROUTE = "/pause"
RESUME_ROUTE = "/resume"
RPC_ROUTE = "/collective_rpc"
SET_VERSION_ROUTE = "/update_weight_version"
VERSION_ROUTE = "/weight_info"
CHECKER_ROUTE = "/weight_checker"
METRICS_ROUTE = "/metrics"
RELOAD_METHOD = "reload_weights"
LOADING_PREFIX = "deltafs-loading:"
DEV_ROUTES = (PAUSE_ROUTE, RESUME_ROUTE, RPC_ROUTE, SET_VERSION_ROUTE, VERSION_ROUTE, CHECKER_ROUTE)
BUSY_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")


class DevRoutesMissingError(EngineError):
    """The server answers, but without the development routes: it was not started in dev mode."""


def pause_params(mode: str) -> dict[str, str]:
    # clear_cache: the prefix/KV cache holds activations of the old weights; in "keep" mode it also
    # preempts running requests so they are recomputed with the new weights rather than mixing two.
    return {"mode": mode, "clear_cache": "true"}


def reload_body(target: Target) -> dict[str, Any]:
    # The dev route passes only string args/kwargs; is_checkpoint_format keeps its default (True).
    return {"method": RELOAD_METHOD, "kwargs": {"weights_path": target.path}}


def version_body(version: str) -> dict[str, Any]:
    return {"new_version": version}


def checksum_body() -> dict[str, Any]:
    return {"action": "checksum"}


def compare_body(baseline: dict[str, str]) -> dict[str, Any]:
    return {"action": "compare", "baseline": baseline}


def loading_label(version: str) -> str:
    """The label while weights are in flux: names no version, so nothing mistakes it for one."""
    return LOADING_PREFIX + version


class VLLMEngine(HttpEngine):
    """One vLLM OpenAI server started with VLLM_SERVER_DEV_MODE=1, reached at url (http://127.0.0.1:8000).

    verify_rollback=True records vLLM's sha256 of every weight (POST /weight_checker) before each
    load and counts a rollback as done only if they match again afterwards; it costs a copy of every
    weight to the host and a sha256 of it, inside the pause. Without it a rollback is trusted when
    the reload succeeds and the label reads back.
    """

    kind = "vllm"
    loads_from_disk = True  # reload_weights re-reads the checkpoint: switch_engine warms the page cache
    engine_name = "vLLM"
    extra = "vllm"
    resume_route = "resume"
    resume_final = (DevRoutesMissingError,)  # a server without /resume cannot have been paused through /pause either

    def __init__(
        self,
        url: str,
        *,
        pause_mode: str = "keep",
        timeout: float = 10.0,
        load_timeout: float = DEFAULT_LOAD_TIMEOUT,
        api_key: str | None = None,
        resume_attempts: int = 4,
        verify_rollback: bool = False,
    ) -> None:
        mode = PAUSE_ALIASES.get(pause_mode, pause_mode)
        if mode not in PAUSE_MODES:
            raise UsageError(f"unknown pause mode {pause_mode!r} for vLLM; use one of {', '.join(PAUSE_MODES)}")
        super().__init__(url, timeout=timeout, load_timeout=load_timeout, resume_attempts=resume_attempts)
        self.pause_mode = mode
        self.verify_rollback = verify_rollback
        self._baseline: dict[str, str] | None = None  # the checksums taken at the start of this switch
        if api_key:  # only /v1/... checks it, but a proxy in front may check every route
            self._session.headers["Authorization"] = f"Bearer {api_key}"

    def __repr__(self) -> str:
        return f"VLLMEngine({self.url!r}, pause_mode={self.pause_mode!r})"

    # --- HTTP -------------------------------------------------------------------------------
    def _call(self, method: str, route: str, body: dict[str, Any] | None, timeout: float,
              params: dict[str, str] | None = None, *, text: bool = False) -> Any:
        """One request; any transport error or non-2xx answer becomes a one-line EngineError."""
        resp = self._send(method, route, body, timeout, params)
        if not 200 <= resp.status_code < 300:
            if resp.status_code == 404 and route in DEV_ROUTES:
                raise DevRoutesMissingError(f"vLLM at {self.url} has no {route} route: start it with VLLM_SERVER_DEV_MODE=1 "
                                  "(deltafs uses the development routes of vLLM 0.33)")
            raise EngineError(f"{method} {route} answered HTTP {resp.status_code}: "
                              f"{short(error_detail(resp, 'error', 'detail', 'message'))}")
        if text:
            return resp.text
        # None: /collective_rpc answers an empty 200 when no worker returned anything
        return json_body(resp, f"{method} {route}")

    def _set_label(self, version: str) -> None:
        self._call("POST", SET_VERSION_ROUTE, version_body(version), self.timeout)

    # --- Engine protocol -------------------------------------------------------------------
    def served_version(self) -> str | None:
        info = self._call("GET", VERSION_ROUTE, None, self.timeout)
        if not isinstance(info, dict):
            raise EngineError(f"GET {VERSION_ROUTE} did not answer a JSON object")
        return reported_version(info)

    def busy_requests(self) -> int | None:
        """Running plus waiting requests over all engines, from the Prometheus gauges at GET /metrics.

        None when the server has no such gauges (no /metrics route, or neither gauge in it): no notion of load.
        Raises EngineError when the load cannot be read (an unreachable server, an error answer): an error is
        never "idle", so an idle boundary keeps waiting instead of switching under running requests.
        """
        resp = self._send("GET", METRICS_ROUTE, None, self.timeout)
        if resp.status_code == 404:
            return None
        if not 200 <= resp.status_code < 300:
            raise EngineError(f"GET {METRICS_ROUTE} answered HTTP {resp.status_code}: "
                              f"{short(error_detail(resp, 'error', 'detail', 'message'))}")
        return busy_from_metrics(resp.text)

    # --- the switch ------------------------------------------------------------------------
    def _pause(self) -> None:
        pause_timeout = self.load_timeout if self.pause_mode == "wait" else self.timeout  # "wait" drains
        self._call("POST", PAUSE_ROUTE, None, pause_timeout, params=pause_params(self.pause_mode))

    def _resume_once(self) -> None:
        self._call("POST", RESUME_ROUTE, None, self.timeout)

    def _switch_paused(self, target: Target, previous: Target | None, state: SwitchState) -> None:
        """label "loading" -> reload_weights -> label target -> check /weight_info, all while paused.

        On failure, previous is reloaded the same way (rollback), still paused, so no request sees
        a mix of versions.
        """
        # Taken before anything changes, so a failure here leaves the weights untouched.
        self._baseline = self._checksums() if self.verify_rollback and previous is not None else None
        super()._switch_paused(target, previous, state)

    def _go_back(self, previous: Target | None) -> tuple[bool, str]:
        if previous is None:
            return False, ("; its weights may be partly replaced (vLLM reloads in place) and no previous "
                           "version was given to go back to")
        if self._rollback(previous, self._baseline):
            return True, f"; serving version {previous.version} again"
        return False, "; could not confirm the previous version is back"

    def _load(self, target: Target) -> None:
        self._set_label(loading_label(target.version))
        try:
            self._call("POST", RPC_ROUTE, reload_body(target), self.load_timeout)
        except EngineUnreachableError:
            raise
        except EngineError as exc:
            raise EngineError(f"{RELOAD_METHOD} from {target.path}: {exc}") from None
        self._set_label(target.version)
        reported = self.served_version()
        if reported != target.version:
            raise EngineError(f"engine reports weight_version {reported!r} after loading {target.version!r}")

    def _rollback(self, previous: Target, baseline: dict[str, str] | None) -> bool:
        try:
            self._load(previous)
            if baseline is not None:
                self._same_as(baseline)
        except EngineError as exc:
            log.critical("rollback to version %s on %s failed: %s", previous.version, self.url, exc)
            try:  # the label must not claim a version the weights may not be
                self._set_label(loading_label(previous.version))
            except EngineError:
                pass
            return False
        log.warning("rolled %s back to version %s%s", self.url, previous.version,
                    " (every tensor's sha256 as before)" if baseline is not None else "")
        return True

    def _checksums(self) -> dict[str, str]:
        """vLLM's sha256 of every weight on every worker, keyed "dp0:pp0:pcp0:tp0:<name>"."""
        data = self._call("POST", CHECKER_ROUTE, checksum_body(), self.load_timeout)
        sums = data.get("checksums") if isinstance(data, dict) else None
        if not isinstance(sums, dict) or not sums:
            raise EngineError(f"POST {CHECKER_ROUTE} answered no checksums")
        return {str(k): str(v) for k, v in sums.items()}

    def _same_as(self, baseline: dict[str, str]) -> None:
        data = self._call("POST", CHECKER_ROUTE, compare_body(baseline), self.load_timeout)
        if not isinstance(data, dict) or data.get("match") is not True:
            differ = data.get("mismatches") if isinstance(data, dict) else None
            names = [str(n) for n in differ] if isinstance(differ, list) else []
            example = f" (e.g. {names[0]})" if names else ""
            raise EngineError(f"{len(names)} tensors differ from before the switch{example}")


def busy_from_metrics(text: str) -> int | None:
    """Sum of the running and waiting gauges (every engine's sample) in Prometheus text; None if absent."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, _, rest = line.partition("{")
        if not rest:
            name, _, rest = line.partition(" ")
        if name.strip() not in BUSY_METRICS:
            continue
        try:
            total += float(rest.rsplit("}", 1)[-1].split()[0])
            seen = True
        except (ValueError, IndexError):
            continue
    return int(total) if seen else None

