"""What both HTTP adapters (SGLang, vLLM) promise alike, run against each one's stand-in server.

The shared part is deltafs/engines/http.py: an unreachable engine is named and recovered from, an
interrupted switch still resumes the engine, resume() unpauses an engine a killed watcher left
paused or says it cannot, and reload_engine switches only when the served version differs.
Engine-specific behaviour stays in test_sglang_adapter.py and test_vllm_adapter.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import requests
from engine_helpers import interrupted_after, same_weights
from sglang_standin import StandinSGLang
from vllm_standin import StandinVLLM

from deltafs.engines import reload_engine
from deltafs.engines.base import SwitchError
from deltafs.engines.sglang import SGLangEngine
from deltafs.engines.vllm import VLLMEngine
from deltafs.errors import EngineError


@dataclass(frozen=True)
class Kit:
    """One engine kind: its adapter, its stand-in, and what differs in the checks below."""

    kind: str
    name: str  # as the adapter's messages name it
    adapter: type[SGLangEngine] | type[VLLMEngine]
    standin: Callable[[str], Any]
    load_event: str  # the stand-in's event for one weight load
    pause: Callable[[str], requests.Response]  # what a killed watcher left behind: a paused engine


KITS = [
    Kit("sglang", "SGLang", SGLangEngine, StandinSGLang, "update",
        lambda url: requests.post(url + "/pause_generation", json={"mode": "abort"})),
    Kit("vllm", "vLLM", VLLMEngine, StandinVLLM, "reload",
        lambda url: requests.post(url + "/pause", params={"mode": "keep"})),
]


@pytest.fixture(params=KITS, ids=[k.kind for k in KITS])
def kit(request: pytest.FixtureRequest) -> Kit:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture()
def server(kit: Kit, ckpts) -> Iterator[Any]:
    with kit.standin(ckpts[0].path) as srv:
        kit.adapter(srv.url, timeout=5, load_timeout=5).switch(ckpts[0], None)  # serving version "1"
        yield srv


def test_engine_refusing_connections_is_reported_then_recovers(kit, server, ckpts):
    v1, _, v2, w2 = ckpts
    engine = kit.adapter(server.url, timeout=1)
    server.stop()
    with pytest.raises(SwitchError, match=f"cannot reach {kit.name}") as info:
        engine.switch(v2, v1)
    assert not info.value.rolled_back
    with pytest.raises(EngineError, match=f"cannot reach {kit.name}"):
        engine.served_version()
    server.start()  # same port: the engine came back
    engine.switch(v2, v1)
    assert same_weights(server.state_dict(), w2) and not server.paused


def test_interrupt_during_load_still_resumes(kit, server, ckpts):
    v1, _, v2, _ = ckpts
    engine = kit.adapter(server.url, load_timeout=10)
    server.inject("hang", seconds=1.0)  # both stand-ins name it so
    with interrupted_after(0.3), pytest.raises(KeyboardInterrupt):
        engine.switch(v2, v1)
    assert not server.paused


def test_resume_unpauses_an_engine_left_paused(kit, server):
    kit.pause(server.url)
    assert server.paused
    kit.adapter(server.url).resume()
    assert not server.paused


def test_resume_gives_up_with_a_clear_error(kit, server):
    server.stop()
    with pytest.raises(EngineError, match=f"cannot reach {kit.name}"):
        kit.adapter(server.url, resume_attempts=2).resume()


def test_reload_engine_is_idempotent(kit, server, ckpts):
    v1, _, v2, w2 = ckpts
    assert reload_engine(kit.kind, server.url, v1.path, 1) is None  # already serving 1
    loads = server.count(kit.load_event)
    result = reload_engine(kit.kind, server.url, v2.path, 2, previous_path=v1.path, previous_version=1)
    assert result is not None and result.version == "2"
    assert server.count(kit.load_event) == loads + 1
    assert reload_engine(kit.kind, server.url, v2.path, 2) is None
    assert server.count(kit.load_event) == loads + 1
    assert same_weights(server.state_dict(), w2)
    assert reload_engine("none", None, v2.path, 2) is None


@pytest.mark.parametrize("adapter", [SGLangEngine, VLLMEngine])
def test_an_answer_dripped_byte_by_byte_times_out_as_a_whole(adapter):
    """A server that sends its answer one byte at a time, each well within the read timeout, never finished: a
    switch polling it held the engine paused forever. The whole request is bounded by connect + read timeout, and
    the next request is answered (on a fresh session)."""
    import json
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    body = json.dumps({"weight_version": "7", "model_path": "/m"}).encode()
    drip = threading.Event()
    drip.set()
    stop = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            for byte in body:
                if drip.is_set():
                    if stop.wait(0.2):
                        return
                self.wfile.write(bytes([byte]))
                self.wfile.flush()

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        engine = adapter(f"http://127.0.0.1:{httpd.server_address[1]}", timeout=0.5)
        started = time.monotonic()
        with pytest.raises(EngineError, match=r"gave no complete answer within 1s"):
            engine.served_version()
        assert time.monotonic() - started < 3  # the drip alone would take ~9 s
        drip.clear()
        assert engine.served_version() == "7"
    finally:
        stop.set()
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("adapter", [SGLangEngine, VLLMEngine])
@pytest.mark.parametrize("status", [200, 500])
def test_a_json_answer_nested_too_deeply_is_an_engine_error(adapter, status):
    """json raised RecursionError on an answer nested 100,000 levels deep; it went past every handler for
    EngineError and ended the watcher (exit 1). It is an engine error now (cron: exit 10; the watcher goes on)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    body = b"[" * 100_000 + b"]" * 100_000

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        engine = adapter(f"http://127.0.0.1:{httpd.server_address[1]}", timeout=10)
        with pytest.raises(EngineError):
            engine.served_version()
    finally:
        httpd.shutdown()
        httpd.server_close()
