"""SGLang 0.5.23's own HTTP and weight-update code, served on 127.0.0.1 around a stand-in scheduler.

What runs is SGLang's, taken from the pinned wheel with `ast` (tests/sglang_wheel.py):
  - the request types of srt/managers/io_struct.py (msgspec Structs; FastAPI validates them, 422 on
    a bad body) and srt/utils/aio_rwlock.py (the update lock);
  - srt/utils/auth.py whole: the API-key middleware and its per-endpoint auth levels;
  - the endpoint bodies of srt/entrypoints/http_server.py (/model_info, /pause_generation,
    /continue_generation, /update_weights_from_disk, /weights_checker, /flush_cache, /health) and
    /v1/loads of srt/entrypoints/v1_loads.py, with their decorators, on a real FastAPI app;
  - TokenizerManager.pause_generation, continue_generation, update_weights_from_disk,
    _wait_for_model_update_from_disk, _handle_update_weights_from_disk_req_output (the shared
    result slot), config_value, record_config_updates, _update_model_path_info, and the mixin's
    _update_weight_version_if_provided and check_weights;
  - the scheduler's SchedulerWeightUpdater.update_weights_from_disk and
    flush_cache_after_weight_update, and the model runner's WeightUpdater.update_weights_from_disk
    (including its half-way-failure recovery, which re-reads the new path).

What is a STAND-IN (ours, named as such): the scheduler process (a thread that takes messages one at
a time, as SGLang's event loop does, and whose cache flush is refused while requests run, as
Scheduler.flush_cache is), the model loader (top-level *.safetensors of model_path, filtered by the
index, copied into named tensors; missing tensors keep their old values), the per-process config
context, the IPC, and the process supervision: when SGLang's code raises where the real server would
crash (a second update result in the shared slot, a failed recovery load), this server dies: it stops
listening and cuts every open connection.

With tokenizer_workers > 1, each connection is served by one of several tokenizer-manager states
(as SGLang's --tokenizer-worker-num processes share one port), each with its own weight_version.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import glob
import hashlib
import json
import logging
import os
import queue
import socket
import sys
import threading
import time
import types
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from http import HTTPStatus
from collections.abc import Callable, Iterator
from typing import Annotated, Any, Literal, Optional

import fastapi
import msgspec
import torch
import uvicorn
from fastapi import Body, FastAPI, Query, Request
from fastapi.responses import ORJSONResponse, Response
from engine_helpers import ServerControls
from safetensors.torch import safe_open
from sglang_wheel import SGLANG_VERSION, extract, source

log = logging.getLogger("sglang-wheel-server")
# SGLang 0.5.23 answers with ORJSONResponse, which newer FastAPI releases deprecate.
warnings.filterwarnings("ignore", message="ORJSONResponse is deprecated")

IO = "sglang/srt/managers/io_struct.py"
TM = "sglang/srt/managers/tokenizer_manager.py"
MIXIN = "sglang/srt/managers/tokenizer_control_mixin.py"
HTTP = "sglang/srt/entrypoints/http_server.py"
LOADS = "sglang/srt/entrypoints/v1_loads.py"
SCHED_UPDATER = "sglang/srt/managers/scheduler_components/weight_updater.py"
RUNNER_UPDATER = "sglang/srt/model_executor/model_runner_components/weight_updater.py"
CHECKER = "sglang/srt/utils/weight_checker.py"

_REQUEST_TYPES = ["PauseGenerationReqInput", "ContinueGenerationReqInput", "UpdateWeightFromDiskReqInput",
                  "UpdateWeightFromDiskReqOutput", "CheckWeightsReqInput", "ParallelismInfo", "ChecksumInfo",
                  "CheckWeightsReqOutput"]


# --- SGLang's code, loaded once per process -------------------------------------------------------
@dataclass
class _SGLangCode:
    io: dict[str, Any]
    auth: dict[str, Any]
    rwlock: type
    overall_checksum: Callable[[dict[str, str]], str]


_CODE: _SGLangCode | None = None


def sglang_code() -> _SGLangCode:
    global _CODE
    if _CODE is None:
        utils = _module("msgspec_utils", source("sglang/srt/utils/msgspec_utils.py"))
        io = _module("io_struct", extract(IO, ["BaseReq"] + _REQUEST_TYPES), {
            "msgspec": msgspec, "Optional": Optional, "List": list, "Dict": dict, "Any": Any, "Literal": Literal,
            "Tuple": tuple, "msgspec_struct_pydantic_core_schema": utils["msgspec_struct_pydantic_core_schema"],
            "msgspec_to_builtins": utils["msgspec_to_builtins"]})
        auth = _module("auth", source("sglang/srt/utils/auth.py"))
        lock = _module("aio_rwlock", source("sglang/srt/utils/aio_rwlock.py"))
        checker = _module("weight_checker", extract(CHECKER, ["overall_checksum"]), {"hashlib": hashlib, "Dict": dict})
        _CODE = _SGLangCode(io, auth, lock["RWLock"], checker["overall_checksum"])
    return _CODE


def _module(name: str, code: str, env: dict[str, Any] | None = None) -> dict[str, Any]:
    """Execute SGLang source as a registered module (dataclasses and msgspec look their module up)."""
    module = types.ModuleType(f"sglang_from_wheel.{name}")
    module.__dict__.update(env or {})
    sys.modules[module.__name__] = module
    exec(compile(code, f"sglang/{name}.py", "exec"), module.__dict__)
    return module.__dict__


def _bind(obj: Any, member: str, names: list[str], cls: str, env: dict[str, Any]) -> None:
    """Execute SGLang's methods `names` of class cls with globals env and bind them to obj."""
    code = "from __future__ import annotations\n" + extract(member, names, cls=cls)
    namespace = dict(env)
    exec(compile(code, f"{os.path.basename(member)}:{cls}", "exec"), namespace)
    for name in names:
        setattr(obj, name, types.MethodType(namespace[name], obj))


# --- stand-ins for the process around that code ---------------------------------------------------
class _Context:
    """STAND-IN for SGLang's per-process config context (get_context()): launch values plus overrides."""

    def __init__(self, launch: dict[str, Any]) -> None:
        self.values = dict(launch)

    def override(self, source_name: str, **fields: Any) -> None:
        self.values.update(fields)

    def config_leaf(self, name: str) -> Any:
        return self.values.get(name)


class _Model:
    """STAND-IN for the model on the GPU: named tensors, loaded once at launch."""

    weight_cache_mode = "off"

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors


def _weight_files(path: str) -> list[str]:
    """Top-level *.safetensors of path, restricted to the index's files when there is one (as SGLang's loader)."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as fh:
            wanted = set(json.load(fh).get("weight_map", {}).values())
        files = [f for f in files if os.path.basename(f) in wanted]
    return files


def _read_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    files = _weight_files(path)
    if not files:
        raise RuntimeError(f"Cannot find any model weights with `{path}`")
    def gen() -> Iterator[tuple[str, torch.Tensor]]:
        for f in files:
            with safe_open(f, framework="pt") as fh:
                for name in fh.keys():
                    yield name, fh.get_tensor(name)
    return gen()


class StandinScheduler:
    """STAND-IN for SGLang's scheduler process: one message at a time, running SGLang's weight updaters."""

    def __init__(self, server: WheelSGLang, model_path: str) -> None:
        self.server = server
        self.model = _Model(dict(_read_tensors(model_path)))
        self.paused = False
        self.running = 0  # requests in the running batch (set by tests)
        self.waiting = 0
        self.weight_version: str | None = None  # what generate responses would carry
        self._queue: queue.Queue[Any] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="sglang-standin-scheduler", daemon=True)
        code = sglang_code()
        self.metrics_collector = None
        # SGLang's scheduler-side updater, bound to this object.
        _bind(self, SCHED_UPDATER, ["_observe_weight_load", "flush_cache_after_weight_update", "update_weights_from_disk"],
              "SchedulerWeightUpdaterManager", {"contextmanager": contextmanager, "time": time, "logger": log,
                                         "Iterator": Iterator, "Tuple": tuple, "Optional": Optional,
                                         "UpdateWeightFromDiskReqOutput": code.io["UpdateWeightFromDiskReqOutput"]})
        self.runner = _StandinRunner(self)
        self.thread.start()

    # what SchedulerWeightUpdater reaches for on its scheduler
    def _select_runners(self, selector: str = "all") -> list[tuple[str, Any]]:
        return [("target", self.runner)]

    def flush_cache(self, empty_cache: bool = True) -> bool:
        # Scheduler.flush_cache: refused unless fully idle; waiting requests do not count while paused.
        idle = self.running == 0 and (self.paused or self.waiting == 0)
        self.server.record("flush_cache", ok=idle)
        return idle

    def record_weight_version_after_update(self, weight_version: str | None) -> None:
        self.weight_version = weight_version

    # the message loop
    def send(self, obj: Any, reply: Callable[[Any], None] | None = None) -> None:
        self._queue.put((obj, reply))

    def stop(self) -> None:
        self._queue.put(None)

    def _loop(self) -> None:
        io = sglang_code().io
        while True:
            item = self._queue.get()
            if item is None:
                return
            obj, reply = item
            try:
                if isinstance(obj, io["UpdateWeightFromDiskReqInput"]):
                    self.server.record("update", model_path=obj.model_path, weight_version=obj.weight_version,
                                       flush_cache=obj.flush_cache)
                    out = self.update_weights_from_disk(obj)
                    self.server.record("update_done", success=out.success, message=out.message)
                elif isinstance(obj, io["PauseGenerationReqInput"]):
                    self.paused = True
                    if obj.mode == "retract":
                        self.waiting, self.running = self.waiting + self.running, 0
                    out = None
                elif isinstance(obj, io["ContinueGenerationReqInput"]):
                    self.paused = False
                    out = None
                elif isinstance(obj, io["CheckWeightsReqInput"]):
                    out = self._checksums(obj)
                else:
                    out = None
            except Exception as exc:  # where SGLang's scheduler process would crash, the server goes down
                self.server.die(f"scheduler crashed: {exc}")
                return
            if reply is not None and out is not None:
                reply(out)

    def abort_all(self) -> None:
        self.running = self.waiting = 0

    def _checksums(self, obj: Any) -> Any:
        io, code = sglang_code().io, sglang_code()
        sums = {name: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                for name, t in sorted(self.model.tensors.items())
                if not any(s in name for s in (obj.skip_tensor_list or ()))}
        place = io["ParallelismInfo"](role="target", tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, pp_rank=0, pp_size=1,
                                      rank=0, size=1)
        info = io["ChecksumInfo"](checksums=sums, per_gpu_checksum=code.overall_checksum(sums), parallelism_info=[place])
        return io["CheckWeightsReqOutput"](success=True, message="", payload=[info])


class _StandinLoader:
    """STAND-IN for DefaultModelLoader: reads model_path's tensors; faults are injected here."""

    class Source:
        @staticmethod
        def init_new(config: Any, model: Any) -> Any:
            return config

    def __init__(self, server: WheelSGLang) -> None:
        self.server = server

    @staticmethod
    def restore_weights_before_loading(model: Any, device: Any) -> None:
        pass

    def _get_weights_iterator(self, config: Any) -> Iterator[tuple[str, torch.Tensor]]:
        return _read_tensors(config.model_path)

    def load_weights_and_postprocess(self, model: _Model, weights: Iterator[tuple[str, torch.Tensor]], device: Any) -> None:
        fault = self.server.take_fault()
        if fault is not None and fault.kind == "slow":
            time.sleep(fault.seconds)
        if fault is not None and fault.kind == "die":
            time.sleep(fault.seconds)
            raise SystemExit("stand-in fault: the server process died during the load")
        for i, (name, tensor) in enumerate(weights):
            if fault is not None and fault.kind in ("fail_halfway", "fail_halfway_always") and i == 1:
                if fault.kind == "fail_halfway_always":
                    self.server.inject("fail_halfway")  # the recovery's re-read fails as well
                raise RuntimeError("stand-in fault: reading tensors failed half-way")
            if fault is not None and fault.kind == "fail":
                raise RuntimeError("stand-in fault: the load failed")
            live = model.tensors.get(name)
            if live is None or live.shape != tensor.shape:
                raise RuntimeError(f"parameter {name} of shape {tuple(tensor.shape)} does not fit the model")
            live.copy_(tensor)


class _StandinRunner:
    """STAND-IN for a model runner; its weight_updater is SGLang's WeightUpdater.update_weights_from_disk."""

    def __init__(self, scheduler: StandinScheduler) -> None:
        self.weight_updater = types.SimpleNamespace()
        wu = self.weight_updater
        wu.device, wu.gpu_id = "cpu", 0
        wu.model_config = types.SimpleNamespace(model_path=None, dtype=torch.float32)
        wu.get_model = lambda: scheduler.model
        wu.update_model_fields = lambda model, **kw: None
        loader = _StandinLoader(scheduler.server)
        env = {"torch": torch, "gc": gc, "logger": log, "Optional": Optional, "Callable": Callable,
               "get_model": lambda: scheduler.model,
               "_unsupported_derived_weight_cache_error": lambda model=None: None,
               "get_available_gpu_memory": lambda *a, **k: 0.0,
               "LoadConfig": lambda **kw: types.SimpleNamespace(**kw),
               "get_pp_stage_load_group": lambda: None,
               "get_model_loader": lambda load_config, model_config: loader,
               "DefaultModelLoader": _StandinLoader,
               "set_default_torch_dtype": lambda dtype: nullcontext()}
        _bind(wu, RUNNER_UPDATER, ["_assert_weight_cache_inactive", "update_weights_from_disk"], "WeightUpdater", env)


class _TokenizerWorker:
    """One tokenizer-manager process's state, with SGLang's own methods bound to it."""

    def __init__(self, server: WheelSGLang, launch_path: str, launch_version: str | None) -> None:
        self.server = server
        self.model_path = self.served_model_name = launch_path
        self.is_pause = False
        self.is_pause_cond = asyncio.Condition()
        self.model_update_lock = sglang_code().rwlock()
        self.model_update_result: Any = None
        self.model_update_tmp: list[Any] = []
        self.model_update_expected_workers = 1
        self.elastic_worker_count = 1
        self.mm_processor = None
        self.gracefully_exit = False
        self.server_status = "Up"
        self.is_generation = True
        self.model_config = types.SimpleNamespace(is_image_understandable_model=False, is_audio_understandable_model=False,
                                                  hf_config=types.SimpleNamespace(model_type="tiny", architectures=["TinyLM"]),
                                                  embedding_model_spec=None)
        self._context = _Context({"weight_version": launch_version or "default", "load_format": "auto",
                                  "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": "null"})
        env = {"asyncio": asyncio, "nullcontext": nullcontext, "logger": log, "hashlib": hashlib,
               "get_context": lambda: self._context, "FanOutCommunicator": _FanOut,
               "msgspec_to_builtins": sglang_code().io["msgspec_to_builtins"],
               "_MANAGER_OWNED_FIELDS": ("model_path", "served_model_name")}
        exec(compile(extract(TM, ["_MANAGER_OWNED_FIELDS"]), "tokenizer_manager.py", "exec"), env)
        _bind(self, TM, ["pause_generation", "continue_generation", "update_weights_from_disk",
                         "_wait_for_model_update_from_disk", "_handle_update_weights_from_disk_req_output",
                         "config_value", "record_config_updates", "_update_model_path_info"], "TokenizerManager", env)
        _bind(self, MIXIN, ["_update_weight_version_if_provided", "check_weights"], "TokenizerControlMixin", env)

    # what those methods reach for: the IPC to the scheduler (stand-in)
    def auto_create_handle_loop(self) -> None:
        pass

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        if abort_all:
            self.server.scheduler.abort_all()

    def _dispatch_to_scheduler(self, obj: Any) -> None:
        loop = asyncio.get_running_loop()

        def reply(out: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the server died meanwhile: nobody waits any more
                loop.call_soon_threadsafe(self.server.deliver, self._handle_update_weights_from_disk_req_output, out)

        self.server.scheduler.send(obj, reply)

    async def _async_dispatch_to_scheduler(self, obj: Any) -> None:
        self.server.record(type(obj).__name__, mode=getattr(obj, "mode", None))
        self.server.scheduler.send(obj)
        if isinstance(obj, sglang_code().io["PauseGenerationReqInput"]) or isinstance(obj, sglang_code().io["ContinueGenerationReqInput"]):
            # SGLang's multi-tokenizer router broadcasts is_pause to every worker.
            for worker in self.server.workers:
                worker.is_pause = self.is_pause

    async def check_weights_communicator(self, obj: Any) -> list[Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        def reply(out: Any) -> None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(fut.set_result, out)

        self.server.scheduler.send(obj, reply)
        return [await fut]

    async def get_loads(self, include: Any = None, dp_rank: Any = None) -> list[Any]:
        sched = self.server.scheduler
        snapshot = {"dp_rank": 0, "num_running_reqs": sched.running, "num_waiting_reqs": sched.waiting,
                    "num_used_tokens": 0, "max_running_requests": 64}
        return [types.SimpleNamespace(to_dict=lambda include=None: dict(snapshot))]

    async def flush_cache(self, timeout_s: float = 0.0) -> Any:
        ok = self.server.scheduler.flush_cache()
        return types.SimpleNamespace(success=ok, message="" if ok else "Cache not flushed because there are pending requests.")


class _FanOut:
    @staticmethod
    def merge_results(results: list[Any]) -> tuple[bool, str]:
        code = "from __future__ import annotations\n" + extract("sglang/srt/managers/communicator.py", ["merge_results"],
                                                                 cls="FanOutCommunicator")
        ns: dict[str, Any] = {}
        exec(code, ns)
        return ns["merge_results"](results)


_current_worker: contextvars.ContextVar[_TokenizerWorker] = contextvars.ContextVar("sglang_worker")


class _GlobalState:
    """http_server's _global_state; tokenizer_manager is the worker serving this connection."""

    @property
    def tokenizer_manager(self) -> _TokenizerWorker:
        return _current_worker.get()


# --- the server -----------------------------------------------------------------------------------
class WheelSGLang(ServerControls):
    """SGLang's HTTP layer and update path on 127.0.0.1, over a stand-in scheduler and model."""

    FAULTS = ("slow", "fail", "fail_halfway", "fail_halfway_always", "die")

    def __init__(self, model_path: str, *, weight_version: str | None = None, api_key: str | None = None,
                 admin_api_key: str | None = None, tokenizer_workers: int = 1, port: int = 0) -> None:
        self.launch_path = os.path.abspath(model_path)
        self.launch_version = weight_version
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.tokenizer_workers = tokenizer_workers
        self._port = port
        self.deaths: list[str] = []
        self._lock = threading.Lock()
        super().__init__(self._lock)  # the event log and injected faults
        self._uvicorn: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.scheduler: StandinScheduler
        self.workers: list[_TokenizerWorker] = []

    # --- lifecycle ---------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    @property
    def alive(self) -> bool:
        return self._uvicorn is not None

    def start(self) -> WheelSGLang:
        """Launch: weights from the launch path, weight_version from the launch argument (or "default")."""
        sglang_code()
        self.scheduler = StandinScheduler(self, self.launch_path)
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), name="sglang-wheel-http", daemon=True)
        self._thread.start()
        if not ready.wait(20):
            raise RuntimeError("the SGLang test server did not start")
        return self

    def _serve(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        self.workers = [_TokenizerWorker(self, self.launch_path, self.launch_version) for _ in range(self.tokenizer_workers)]
        app = self._app()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self._port))
        self._port = sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="critical", loop="none", lifespan="off", timeout_graceful_shutdown=0)
        server = uvicorn.Server(config)
        self._uvicorn = server

        async def main() -> None:
            task = asyncio.create_task(server.serve(sockets=[sock]))
            while not server.started and not task.done():
                await asyncio.sleep(0.01)
            ready.set()
            with contextlib.suppress(BaseException):
                await task

        try:
            loop.run_until_complete(main())
        finally:
            sock.close()
            loop.close()

    def _app(self) -> FastAPI:
        code = sglang_code()
        app = FastAPI()
        env: dict[str, Any] = {
            "app": app, "Annotated": Annotated, "Body": Body, "Request": Request, "Optional": Optional, "Query": Query,
            "Response": Response, "ORJSONResponse": ORJSONResponse, "HTTPStatus": HTTPStatus, "logger": log,
            "auth_level": code.auth["auth_level"], "AuthLevel": code.auth["AuthLevel"], "_global_state": _GlobalState(),
            "msgspec_to_builtins": code.io["msgspec_to_builtins"],
            "get_serving": lambda: types.SimpleNamespace(tokenizer_path=_current_worker.get().model_path,
                                                         preferred_sampling_params=None),
            "envs": types.SimpleNamespace(SGLANG_DIAG_BYPASS_HEALTH_GENERATE=_Flag(False),
                                          SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=_Flag(False)),
            "ServerStatus": types.SimpleNamespace(Starting="Starting", Up="Up"),
            **{name: code.io[name] for name in _REQUEST_TYPES},
        }
        endpoints = ["health_generate", "model_info", "flush_cache", "update_weights_from_disk", "check_weights",
                     "pause_generation", "continue_generation"]
        exec(compile(extract(HTTP, endpoints), "http_server.py", "exec"), env)
        router = fastapi.APIRouter()
        loads_env: dict[str, Any] = {"router": router, "Optional": Optional, "Depends": fastapi.Depends, "time": time,
                                     "HTTPException": fastapi.HTTPException, "Response": Response,
                                     "__version__": SGLANG_VERSION, "_accelerator_name": lambda: None,
                                     "_num_accelerators_per_dp_rank": lambda: 1,
                                     "_get_tokenizer_manager": lambda: _current_worker.get(),
                                     "_format_loads_prometheus": None}
        exec("from datetime import datetime, timezone\n" + extract(LOADS, ["get_loads"]), loads_env)
        app.include_router(router)
        code.auth["add_api_key_middleware"](app, api_key=self.api_key, admin_api_key=self.admin_api_key)
        return _WorkerPerConnection(app, self)

    def die(self, reason: str) -> None:
        """What SGLang's watchdog does when a process fails: the whole server goes away."""
        with self._lock:
            self.deaths.append(reason)
        self.record("died", reason=reason)
        server, loop = self._uvicorn, self._loop
        self._uvicorn = None
        if server is None or loop is None:
            return
        server.should_exit = server.force_exit = True

        def cut() -> None:
            for listener in getattr(server, "servers", []):
                listener.close()  # stop accepting at once, before uvicorn's own shutdown
            for conn in list(server.server_state.connections):
                transport = getattr(conn, "transport", None)
                if transport is not None:
                    transport.abort()
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(cut)
        self.scheduler.stop()
        if threading.current_thread() is not self._thread and self._thread is not None:
            self._thread.join(10)

    def stop(self) -> None:
        if self._uvicorn is not None:
            self.die("stopped by the test")

    def restart(self) -> WheelSGLang:
        """A new process on the same port: launch path and launch weight_version again."""
        self.stop()
        if self._thread is not None:
            self._thread.join(10)
        return self.start()

    def __enter__(self) -> WheelSGLang:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- plumbing used by the code above -------------------------------------------------------
    def deliver(self, handler: Callable[[Any], None], out: Any) -> None:
        """Hand a scheduler result to SGLang's handler; where it raises, SGLang's handle loop dies."""
        try:
            handler(out)
        except Exception as exc:
            self.die(f"tokenizer manager handle loop crashed: {type(exc).__name__}: {exc}")

    # --- test controls -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.scheduler.model.tensors.items()}

    @property
    def paused(self) -> bool:
        """Whether the tokenizer manager holds new requests (the scheduler follows once it takes the message)."""
        return any(w.is_pause for w in self.workers)

    def reported_versions(self) -> list[str]:
        return [str(w._context.config_leaf("weight_version")) for w in self.workers]


class _Flag:
    def __init__(self, value: bool) -> None:
        self.value = value

    def get(self) -> bool:
        return self.value


class _WorkerPerConnection:
    """ASGI wrapper: each TCP connection is served by one tokenizer worker, round robin (as processes sharing a port)."""

    def __init__(self, app: Any, server: WheelSGLang) -> None:
        self.app = app
        self.server = server
        self._by_client: dict[Any, _TokenizerWorker] = {}
        self._next = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        client = tuple(scope.get("client") or ())
        worker = self._by_client.get(client)
        if worker is None:
            worker = self.server.workers[self._next % len(self.server.workers)]
            self._next += 1
            self._by_client[client] = worker
        _current_worker.set(worker)
        await self.app(scope, receive, send)
