"""A named stand-in for an SGLang server: the HTTP endpoints deltafs uses, with SGLang's shapes.

SGLang needs a GPU, which CI lacks. This server implements, with the JSON shapes and status codes of
SGLang 0.5.23 (sglang/srt/entrypoints/http_server.py and v1_loads.py):

    POST /pause_generation        {"mode": "abort"|"retract"|"in_place"} -> {"message", "status"}
    POST /continue_generation     {...}                                  -> {"message", "status"}
    POST /update_weights_from_disk {"model_path", "weight_version", ...} -> {"success", "message",
                                   "num_paused_requests"}; HTTP 200, or 400 with success false
    GET  /model_info              -> {..., "weight_version"}  ("default" until an update sets one)
    GET  /v1/loads                -> {"loads": [{"dp_rank", "num_running_reqs", "num_waiting_reqs", ...}]}
    POST /generate                {"text"|"input_ids", "sampling_params"} -> {"text", "output_ids",
                                   "meta_info": {"weight_version", ...}}
    GET  /health

It loads every *.safetensors file of model_path into a real (tiny) torch model and answers
/generate greedily from it, so a test can tell which weights are live. As SGLang does: pausing in
abort mode aborts the requests in flight (finish_reason "abort"); in retract and in_place modes they
stop between tokens and go on after continue_generation, and a response whose tokens came from two
versions carries meta_info.weight_versions spans; bodies are validated (an integer weight_version
or a missing model_path is 422); /health answers 200 with an empty body. Faults for the next
update(s) are injected with `inject()` or POST /standin/fault: http500, success_false, hang, slow,
wrong_version.

Updates are NOT serialized here, and a second update while one runs is not modelled: what SGLang
does then (a shared result slot, a crash) is tested against SGLang's own code in
tests/sglang_wheel_server.py. Use this stand-in where a real model must answer /generate.

Run standalone: python tests/sglang_standin.py --model-path DIR [--port 0]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from engine_helpers import ModelServerControls
from safetensors.torch import load_file, save_file

PAUSE_MODES = ("abort", "retract", "in_place")


# --- the model ------------------------------------------------------------------------------------
class TinyLM(torch.nn.Module):
    """Embedding, one gated MLP block with RMSNorm, lm_head: HF-style names, a few KB of weights."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(vocab_size, hidden_size, dtype=dtype)
        layer = torch.nn.Module()
        layer.mlp = torch.nn.Module()
        layer.mlp.up_proj = torch.nn.Linear(hidden_size, 2 * hidden_size, bias=False, dtype=dtype)
        layer.mlp.down_proj = torch.nn.Linear(2 * hidden_size, hidden_size, bias=False, dtype=dtype)
        layer.post_attention_layernorm = torch.nn.RMSNorm(hidden_size, dtype=dtype)
        self.model.layers = torch.nn.ModuleList([layer])
        self.model.norm = torch.nn.RMSNorm(hidden_size, dtype=dtype)
        self.lm_head = torch.nn.Linear(hidden_size, vocab_size, bias=False, dtype=dtype)
        # A buffer, so in-place adapters are tested on buffers too.
        self.register_buffer("logit_bias", torch.zeros(vocab_size, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(ids)
        layer = self.model.layers[0]
        h = h + layer.mlp.down_proj(torch.nn.functional.silu(layer.mlp.up_proj(layer.post_attention_layernorm(h))))
        return self.lm_head(self.model.norm(h)) + self.logit_bias


def tiny_config(vocab_size: int = 64, hidden_size: int = 16, dtype: str = "bfloat16") -> dict[str, Any]:
    return {"architectures": ["TinyLM"], "model_type": "tiny", "vocab_size": vocab_size,
            "hidden_size": hidden_size, "torch_dtype": dtype}


def build_model(config: dict[str, Any]) -> TinyLM:
    return TinyLM(int(config["vocab_size"]), int(config["hidden_size"]), getattr(torch, config["torch_dtype"]))


def random_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """A full state dict for TinyLM with deterministic random values."""
    gen = torch.Generator().manual_seed(seed)
    model = build_model(config)
    out = {}
    for name, t in model.state_dict().items():
        out[name] = (torch.randn(t.shape, generator=gen) * 0.5).to(t.dtype)
    return out


def write_checkpoint(directory: str, tensors: dict[str, torch.Tensor], config: dict[str, Any] | None = None) -> str:
    """An HF-style checkpoint directory: config.json and model.safetensors."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as fh:
        json.dump(config or tiny_config(), fh, sort_keys=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(directory, "model.safetensors"))
    return directory


def load_checkpoint(path: str) -> tuple[dict[str, Any], TinyLM]:
    """The server's normal loader: config.json plus every *.safetensors file, strictly."""
    with open(os.path.join(path, "config.json")) as fh:
        config = json.load(fh)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    model = build_model(config)
    model.load_state_dict(state, strict=True)
    model.eval()
    return config, model


def greedy(model: TinyLM, vocab_size: int, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = list(prompt_ids)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids[-8:]]))[0, -1]
            nxt = int(torch.argmax(logits.float()))
            out.append(nxt)
            ids.append(nxt)
    return out


# --- the server -----------------------------------------------------------------------------------
class StandinSGLang(ModelServerControls):
    """The stand-in server; start() binds 127.0.0.1 and serves in a background thread."""

    FAULTS = ("http500", "success_false", "hang", "slow", "wrong_version")

    def __init__(self, model_path: str, *, port: int = 0, token_delay: float = 0.0) -> None:
        self.model_path = os.path.abspath(model_path)
        self.config, self.model = load_checkpoint(self.model_path)
        self.weight_version = "default"
        self.paused = False
        self.pause_mode: str | None = None
        self.token_delay = token_delay
        self.running = 0
        self.waiting = 0
        self._cond = threading.Condition()  # guards everything above and wakes paused generators
        super().__init__(self._cond)  # the event log and injected faults, under the same lock
        self._abort_epoch = 0  # bumped by an abort-mode pause: requests in flight end
        self._port = port
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()  # open keep-alive connections, cut by stop()

    # --- lifecycle -------------------------------------------------------------------------
    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def start(self) -> StandinSGLang:
        """Bind (the same port again after stop(), to simulate an engine that comes back)."""
        server = self

        class Handler(_Handler):
            standin = server

        httpd = ThreadingHTTPServer(("127.0.0.1", self._port), Handler)
        httpd.daemon_threads = True
        self._port = httpd.server_address[1]
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="sglang-standin", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening: connections are refused until start() is called again."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        with self._cond:
            conns, self._conns = list(self._conns), set()
        for conn in conns:  # a dead server also drops the clients' keep-alive connections
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self) -> StandinSGLang:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self.paused = False  # release waiting generate requests so their threads end
            self._cond.notify_all()
        self.stop()

    # --- test controls (and ModelServerControls' inject, record, count, state_dict) ----------------
    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        with self._cond:
            model = self.model
        return greedy(model, int(self.config["vocab_size"]), prompt_ids, max_new_tokens)

    # --- endpoint logic ---------------------------------------------------------------------
    def pause(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return 422, {"detail": [{"loc": ["body", "mode"], "msg": f"Input should be {PAUSE_MODES}", "type": "literal_error"}]}
        with self._cond:
            self.paused = True
            self.pause_mode = mode
            if mode == "abort":
                self._abort_epoch += 1
                self._cond.notify_all()
        self.record("pause", mode=mode)
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def resume(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self._cond:
            self.paused = False
            self.pause_mode = None
            self._cond.notify_all()
        self.record("continue")
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def update(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if not isinstance(body.get("model_path"), str):
            return 422, {"detail": [{"loc": ["body", "model_path"], "msg": "Field required", "type": "missing"}]}
        if body.get("weight_version") is not None and not isinstance(body["weight_version"], str):
            return 422, {"detail": [{"loc": ["body", "weight_version"], "msg": "Input should be a valid string",
                                     "type": "string_type"}]}
        return self._update(body)

    def _update(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        path, version = body["model_path"], body.get("weight_version")
        fault = self.take_fault()
        self.record("update", model_path=path, weight_version=version, fault=fault.kind if fault else None)
        if fault and fault.kind == "http500":
            return 500, {"detail": "Internal Server Error"}
        if fault and fault.kind == "success_false":
            return 400, {"success": False, "message": "Failed to update weights: injected failure", "num_paused_requests": 0}
        if fault and fault.kind in ("hang", "slow"):
            time.sleep(fault.seconds)
        try:
            config, model = load_checkpoint(path)
        except Exception as exc:  # SGLang keeps the old weights and answers 400 on a failed load
            self.record("update_failed", error=str(exc))
            return 400, {"success": False, "message": f"Failed to update weights: {exc}. Rolling back to original weights.",
                         "num_paused_requests": 0}
        with self._cond:
            self.config, self.model, self.model_path = config, model, os.path.abspath(path)
            if version is not None:
                self.weight_version = str(version)
            if fault and fault.kind == "wrong_version":
                self.weight_version = "not-" + str(version)
        self.record("loaded", model_path=path, weight_version=version)
        return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    def model_info(self) -> dict[str, Any]:
        with self._cond:
            return {
                "model_path": self.model_path, "served_model_name": self.model_path, "tokenizer_path": self.model_path,
                "is_generation": True, "preferred_sampling_params": None, "weight_version": self.weight_version,
                "load_format": "auto", "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": "null",
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": self.config.get("model_type"), "architectures": self.config.get("architectures"),
            }

    def loads(self) -> dict[str, Any]:
        with self._cond:
            core = {"dp_rank": 0, "timestamp": time.time(), "num_running_reqs": self.running,
                    "num_waiting_reqs": self.waiting, "num_used_tokens": 0, "max_running_requests": 64}
        return {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "version": "0.5.23-standin",
                "accelerator": None, "num_accelerators": 1, "loads": [core]}

    def generate(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        params = body.get("sampling_params") or {}
        max_new = int(params.get("max_new_tokens", 8))
        if "input_ids" in body:
            prompt = [int(i) for i in body["input_ids"]]
        else:
            prompt = list(str(body.get("text", "")).encode())
        vocab = int(self.config["vocab_size"])
        prompt = [i % vocab for i in prompt] or [0]
        with self._cond:
            self.waiting += 1
            while self.paused:  # a new request waits for continue_generation
                self._cond.wait(0.05)
            self.waiting -= 1
            self.running += 1
            epoch = self._abort_epoch
        out: list[int] = []
        versions: list[str] = []
        finish: dict[str, Any] = {"type": "length", "length": max_new}
        try:
            ids = list(prompt)
            for _ in range(max_new):
                with self._cond:  # between tokens: an abort ends the request, retract/in_place hold it
                    while self.paused and self._abort_epoch == epoch:
                        self._cond.wait(0.05)
                    if self._abort_epoch != epoch:
                        finish = {"type": "abort", "message": "Abort all requests"}
                        break
                    model, version = self.model, self.weight_version
                if self.token_delay:
                    time.sleep(self.token_delay)
                with torch.no_grad():
                    logits = model(torch.tensor([ids[-8:]]))[0, -1]
                nxt = int(torch.argmax(logits.float()))
                out.append(nxt)
                versions.append(version)
                ids.append(nxt)
        finally:
            with self._cond:
                self.running -= 1
        version = versions[-1] if versions else self.weight_version
        self.record("generated", weight_version=version, tokens=len(out))
        text = bytes(i % 256 for i in out).decode("latin-1")
        meta: dict[str, Any] = {"id": uuid.uuid4().hex, "finish_reason": finish, "prompt_tokens": len(prompt),
                                "completion_tokens": len(out), "weight_version": version}
        if len(set(versions)) > 1:  # SGLang's spans: [{"version", "start", "end"}] over the output tokens
            spans: list[dict[str, Any]] = []
            for i, v in enumerate(versions):
                if spans and spans[-1]["version"] == v:
                    spans[-1]["end"] = i + 1
                else:
                    spans.append({"version": v, "start": i, "end": i + 1})
            meta["weight_versions"] = spans
        return 200, {"text": text, "output_ids": out, "meta_info": meta}


class _Handler(BaseHTTPRequestHandler):
    standin: StandinSGLang
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as separate writes; don't wait on delayed ACKs

    def log_message(self, format: str, *args: Any) -> None:  # quiet: tests read events instead
        pass

    def setup(self) -> None:
        super().setup()
        with self.standin._cond:
            self.standin._conns.add(self.connection)

    def finish(self) -> None:
        with self.standin._cond:
            self.standin._conns.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    def _send(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict[str, Any] | None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not raw:
            return {}
        try:
            value = json.loads(raw)
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    def do_GET(self) -> None:
        s = self.standin
        route = self.path.split("?", 1)[0]
        if route == "/model_info":
            self._send(200, s.model_info())
        elif route == "/v1/loads":
            self._send(200, s.loads())
        elif route == "/health":
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif route == "/get_weight_version":
            self._send(404, {"detail": "deprecated, use /model_info"})
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        s = self.standin
        body = self._body()
        if body is None:
            self._send(HTTPStatus.UNPROCESSABLE_ENTITY, {"detail": [{"type": "json_invalid", "loc": ["body"],
                                                                     "msg": "JSON decode error"}]})
            return
        route = self.path.split("?", 1)[0]
        if body == {} and route in ("/update_weights_from_disk", "/pause_generation", "/continue_generation", "/generate") and \
                not int(self.headers.get("Content-Length") or 0):
            # FastAPI: a required body that is absent is 422, even where every field has a default.
            self._send(HTTPStatus.UNPROCESSABLE_ENTITY, {"detail": [{"type": "missing", "loc": ["body"],
                                                                     "msg": "Field required", "input": None}]})
            return
        routes = {
            "/pause_generation": s.pause,
            "/continue_generation": s.resume,
            "/update_weights_from_disk": s.update,
            "/generate": s.generate,
            "/standin/fault": self._fault,
        }
        handler = routes.get(self.path.split("?", 1)[0])
        if handler is None:
            self._send(404, {"detail": "Not Found"})
            return
        status, payload = handler(body)
        self._send(status, payload)

    def _fault(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        try:
            self.standin.inject(str(body.get("kind")), count=int(body.get("count", 1)), seconds=float(body.get("seconds", 0)))
        except ValueError as exc:
            return 400, {"detail": str(exc)}
        return 200, {"status": "ok"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token-delay", type=float, default=0.0)
    args = parser.parse_args()
    server = StandinSGLang(args.model_path, port=args.port, token_delay=args.token_delay).start()
    print(f"listening on {server.url}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
