"""A named stand-in for a vLLM 0.33 OpenAI server: vLLM's own route handlers around a stand-in engine.

vLLM needs a GPU and its wheel is ~336 MB, which CI lacks. The route handlers deltafs talks to are
vLLM's real code: the source text of vllm/entrypoints/rl/online/api_router.py (/pause, /resume,
/is_paused, /update_weight_version, /weight_info, ...), vllm/entrypoints/serve/dev/rpc/api_router.py
(/collective_rpc), vllm/entrypoints/serve/middleware/authenticate.py (--api-key) and
vllm/model_executor/model_loader/weight_checksum.py (the digests /weight_checker returns), committed under
tests/engines/data/vllm-0.33.0/, is parsed and executed here on real FastAPI, with its `vllm.*`
imports replaced by the stand-ins below. Mounted as vLLM mounts them: the development routes only
with dev_mode=True (VLLM_SERVER_DEV_MODE=1).

Stand-ins (not vLLM's code): StandinEngineClient (the AsyncLLM methods those handlers call),
StandinWorker (a worker's reload_weights: reads every *.safetensors file of weights_path and copies
the tensors into a tiny torch model in place, like vLLM's in-place reload, so a failure half way
leaves a mix), GET /metrics (the two scheduler gauges, in Prometheus text), POST /v1/completions
(greedy tokens; waits while paused in "keep" mode, 503 in "abort"/"wait" mode) and the error handler
(vLLM's {"error": {"message", "type", "code"}} shape). Faults for the next reloads are injected with
inject(): error, midway, hang, slow; failing /resume calls with resume_failures.
"""

from __future__ import annotations

import ast
import asyncio
import glob
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from safetensors.torch import load_file
from engine_helpers import ModelServerControls
from sglang_standin import TinyLM, greedy, load_checkpoint

VLLM_VERSION = "0.33.0"
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", f"vllm-{VLLM_VERSION}")

def source_path(name: str) -> str:
    return os.path.join(DATA, name)


def read_source(name: str) -> ast.Module:
    with open(source_path(name), encoding="utf-8") as fh:
        return ast.parse(fh.read(), filename=source_path(name))


def pause_modes() -> tuple[str, ...]:
    """vLLM's PauseMode literal, read from the pinned source."""
    node = read_source("v1_engine_init.py.txt").body[0]
    assert isinstance(node, ast.Assign) and isinstance(node.value, ast.Subscript)
    elts = node.value.slice.elts if isinstance(node.value.slice, ast.Tuple) else [node.value.slice]
    return tuple(e.value for e in elts if isinstance(e, ast.Constant))


def exec_vllm_module(name: str, substitutes: dict[str, Any]) -> dict[str, Any]:
    """Execute a pinned vLLM source file with its vllm.* (and relative) imports replaced by substitutes.

    Every name those imports bind must have a substitute, so a new vLLM import fails loudly here
    instead of as a NameError deep in a request.
    """
    tree = read_source(name)
    kept: list[ast.stmt] = []
    needed: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "vllm"):
            needed.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "vllm" for a in node.names):
            needed.update((a.asname or a.name).split(".")[0] for a in node.names)
        else:
            kept.append(node)
    missing = sorted(needed - set(substitutes))
    if missing:
        raise RuntimeError(f"vllm {VLLM_VERSION} {name} imports {missing}; give the stand-in a substitute")
    tree.body = kept
    namespace: dict[str, Any] = {"__name__": f"vllm_standin.{name.split('.')[0]}", **substitutes}
    exec(compile(tree, source_path(name), "exec"), namespace)
    return namespace


# --- substitutes for the vllm.* names the handlers import ------------------------------------------
class _Metrics:
    @contextmanager
    def record(self, operation: str) -> Iterator[None]:
        yield


@dataclass
class _WeightTransferRequest:  # the weight-transfer routes are mounted but deltafs never calls them
    init_info: Any = None
    update_info: Any = None


def _substitutes() -> dict[str, Any]:
    modes = pause_modes()
    return {
        "EngineClient": StandinEngineClient,
        "init_logger": logging.getLogger,
        "PauseMode": Literal[modes],  # type: ignore[valid-type]
        "weight_operation_metrics": _Metrics,
        "WeightTransferInitRequest": _WeightTransferRequest,
        "WeightTransferUpdateRequest": _WeightTransferRequest,
        "WeightTransferUpdatePayload": dict[str, Any] | list[dict[str, Any]],
    }


class _SharedWeightParameter:  # vLLM's class for weights shared by layers; the tiny model has none
    partitions: dict[int, torch.Tensor] = {}


def _weight_checksum() -> dict[str, Any]:
    """vLLM's per-parameter sha256 code (model_loader/weight_checksum.py)."""
    return exec_vllm_module("weight_checksum.py.txt", {"SharedWeightParameter": _SharedWeightParameter})


# --- the stand-in engine ----------------------------------------------------------------------------
class StandinWorker:
    """One worker: the methods /collective_rpc may name, over a tiny torch model."""

    def __init__(self, server: StandinVLLM) -> None:
        self.server = server

    def reload_weights(self, weights_iterator: Any = None, weights_path: str | None = None,
                       is_checkpoint_format: bool = True) -> None:
        """In place, tensor by tensor, as vLLM does; a tensor the checkpoint lacks keeps its old value."""
        srv = self.server
        fault = srv.take_fault()
        srv.record("reload", weights_path=weights_path, fault=fault.kind if fault else None)
        if fault and fault.kind in ("hang", "slow"):
            time.sleep(fault.seconds)
        if fault and fault.kind == "error":
            raise RuntimeError("injected reload failure")
        path = weights_path or srv.model_path
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise RuntimeError(f"Cannot find any model weights with `{path}`")
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update(load_file(f))
        with srv.lock:
            params = srv.model.state_dict()
            for i, (name, tensor) in enumerate(sorted(tensors.items())):
                if fault and fault.kind == "midway" and i == len(tensors) // 2:
                    raise RuntimeError(f"injected failure after {i} of {len(tensors)} tensors")
                if name not in params:
                    raise KeyError(name)
                params[name].copy_(tensor)
            srv.model_path = path
        srv.record("reloaded", weights_path=path)


class StandinEngineClient:
    """The AsyncLLM methods vLLM's route handlers call; utility calls run one at a time, as in EngineCore."""

    def __init__(self, server: StandinVLLM) -> None:
        self.server = server
        self.worker = StandinWorker(server)
        self._utility = asyncio.Lock()

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        if mode not in pause_modes():
            raise ValueError(f"Invalid pause mode: {mode}")
        srv = self.server
        with srv.lock:
            srv.paused, srv.pause_mode = True, mode
        srv.record("pause", mode=mode, clear_cache=clear_cache)

    async def resume_generation(self) -> None:
        srv = self.server
        with srv.lock:
            if srv.resume_failures > 0:  # vLLM's handler turns this into HTTP 500 {"error": ...}
                srv.resume_failures -= 1
                raise RuntimeError("injected resume failure")
            srv.paused, srv.pause_mode = False, None
        srv.record("resume")

    async def is_paused(self) -> bool:
        return self.server.paused

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None) -> list[Any]:
        async with self._utility:
            self.server.record("rpc", method=method, kwargs=dict(kwargs or {}))
            func = getattr(self.worker, method)  # like vLLM's run_method: an unknown name raises
            return [await asyncio.to_thread(func, *args, **(kwargs or {}))]

    async def compute_weight_checksums(self) -> list[dict[str, str]]:
        """One dict per worker, as vLLM's Worker.compute_weight_checksums: its real digest code, prefixed."""
        async with self._utility:
            self.server.record("checksums")
            digests = _weight_checksum()["compute_tensor_digests"]
            with self.server.lock:
                return [{"dp0:pp0:pcp0:tp0:" + k: v for k, v in digests(self.server.model).items()}]

    async def update_weight_version(self, new_version: str) -> None:
        async with self._utility:
            with self.server.lock:
                self.server.weight_version = new_version
            self.server.record("label", version=new_version)

    async def get_weight_version(self) -> str:
        async with self._utility:
            return self.server.weight_version


class StandinVLLM(ModelServerControls):
    """The stand-in server; start() binds 127.0.0.1 and serves (uvicorn) in a background thread."""

    FAULTS = ("error", "midway", "hang", "slow")

    def __init__(self, model_path: str, *, port: int = 0, dev_mode: bool = True, api_key: str | None = None,
                 token_delay: float = 0.0) -> None:
        self.model_path = os.path.abspath(model_path)
        self.config, self.model = load_checkpoint(self.model_path)
        self.weight_version = "default"
        self.paused = False
        self.pause_mode: str | None = None
        self.resume_failures = 0  # the next this many /resume calls fail
        self.running = 0
        self.waiting = 0
        self.token_delay = token_delay
        self.lock = threading.RLock()
        super().__init__(self.lock)  # the event log and injected faults
        self.dev_mode = dev_mode
        self.api_key = api_key
        self._port = port
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> StandinVLLM:
        """Bind (the same port again after stop(), to simulate an engine that comes back)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self._port))
        self._port = sock.getsockname()[1]
        config = uvicorn.Config(build_app(self), log_level="critical", lifespan="off", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="vllm-standin", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the vLLM stand-in did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop listening: connections are refused until start() is called again."""
        if self._server is not None:
            self._server.should_exit = True
            if self._thread is not None:
                self._thread.join(timeout=10)
            self._server = None

    def __enter__(self) -> StandinVLLM:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self.paused = False
        self.stop()

    # --- test controls (and ModelServerControls' inject, record, count, state_dict) ----------------
    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        with self.lock:
            return greedy(self.model, int(self.config["vocab_size"]), prompt_ids, max_new_tokens)

    def metrics_text(self) -> str:
        with self.lock:
            running, waiting = self.running, self.waiting
        labels = '{engine="0",model_name="tiny"}'
        return (f"# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
                f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{labels} {float(running)}\n"
                f"# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
                f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{labels} {float(waiting)}\n"
                f'vllm:num_requests_waiting_by_reason{{engine="0",model_name="tiny",reason="capacity"}} 7.0\n')


def build_app(server: StandinVLLM) -> FastAPI:
    """vLLM's handlers (dev routes only in dev mode, as vLLM mounts them) plus the stand-in routes."""
    app = FastAPI()
    app.state.engine_client = StandinEngineClient(server)
    if server.dev_mode:
        subs = _substitutes()
        app.include_router(exec_vllm_module("rl_online_api_router.py.txt", subs)["router"])
        exec_vllm_module("dev_rpc_api_router.py.txt", subs)["attach_router"](app)
    if server.api_key:
        auth = exec_vllm_module("middleware_authenticate.py.txt", {})["AuthenticationMiddleware"]
        app.add_middleware(auth, tokens=[server.api_key])

    async def error_response(request: Request, exc: Exception) -> JSONResponse:
        # Stand-in for vLLM's handlers: same body shape, HTTPException status or 500.
        code = exc.status_code if isinstance(exc, HTTPException) else 500
        message = exc.detail if isinstance(exc, HTTPException) else str(exc)
        kind = "BadRequestError" if code == 400 else "InternalServerError"
        return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, status_code=code)

    app.add_exception_handler(HTTPException, error_response)
    app.add_exception_handler(Exception, error_response)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(server.metrics_text())

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": server.model_path, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        body = await request.json()
        prompt = [int(i) % int(server.config["vocab_size"]) for i in body.get("prompt") or [0]]
        with server.lock:
            if server.paused and server.pause_mode != "keep":
                return JSONResponse({"error": {"message": "engine paused", "code": 503}}, status_code=503)
            server.waiting += 1
        while server.paused:  # "keep": queued until /resume
            await asyncio.sleep(0.01)
        with server.lock:
            server.waiting -= 1
            server.running += 1
        try:
            await asyncio.sleep(server.token_delay * int(body.get("max_tokens", 8)))
            ids = await asyncio.to_thread(server.generate_ids, prompt, int(body.get("max_tokens", 8)))
            return JSONResponse({"choices": [{"index": 0, "token_ids": ids}], "weight_version": server.weight_version})
        finally:
            with server.lock:
                server.running -= 1

    return app


__all__ = ["StandinVLLM", "TinyLM", "exec_vllm_module", "pause_modes", "read_source"]
