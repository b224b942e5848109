"""Task boundaries: immediate, idle (the engine's own request count) and signal (file, SIGUSR1, HTTP)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import requests
from watch_helpers import FAST, same_weights, wait_until

from deltafs.engines.sglang import SGLangEngine
from deltafs.errors import UsageError
from deltafs.watch import Subscriber
from deltafs.watch.boundary import Idle, Immediate, Signal, make_boundary


def in_thread(fn):
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


def test_immediate_returns_at_once_unless_stopping():
    stop = threading.Event()
    assert Immediate().wait(None, stop)
    stop.set()
    assert not Immediate().wait(None, stop)


def test_idle_waits_for_running_requests_to_finish(engine_server):
    engine_server.token_delay = 0.05
    engine = SGLangEngine(engine_server.url)
    gen, _ = in_thread(lambda: requests.post(engine_server.url + "/generate",
                                             json={"text": "x", "sampling_params": {"max_new_tokens": 20}}))
    wait_until(lambda: engine.busy_requests() == 1)
    started = time.monotonic()
    assert Idle(max_wait=10, interval=0.02).wait(engine, threading.Event())
    waited = time.monotonic() - started
    assert engine.busy_requests() == 0 and waited > 0.2  # it really waited for the request
    gen.join()


def test_idle_switches_anyway_after_max_wait(engine_server):
    engine_server.token_delay = 0.1
    engine = SGLangEngine(engine_server.url)
    gen, _ = in_thread(lambda: requests.post(engine_server.url + "/generate",
                                             json={"text": "x", "sampling_params": {"max_new_tokens": 8}}))
    wait_until(lambda: engine.busy_requests() == 1)
    started = time.monotonic()
    assert Idle(max_wait=0.3, interval=0.02).wait(engine, threading.Event())
    assert 0.3 <= time.monotonic() - started < 5  # it gave up waiting, it did not wait for the request
    assert engine.busy_requests() == 1
    gen.join()


def test_idle_boundary_in_a_sync_switches_only_when_idle(trainer, tmp_path, engine_server):
    trainer.push()
    engine_server.token_delay = 0.05
    sub = Subscriber(trainer.store, str(tmp_path / "dest"), SGLangEngine(engine_server.url),
                     boundary=Idle(max_wait=10, interval=0.02), host_id="h", **FAST)
    sub.start()
    gen, _ = in_thread(lambda: requests.post(engine_server.url + "/generate",
                                             json={"text": "x", "sampling_params": {"max_new_tokens": 10}}))
    wait_until(lambda: engine_server.running == 1)
    sub.sync()
    gen.join()
    assert engine_server.weight_version == "1"
    assert same_weights(engine_server.state_dict(), trainer.weights[1])
    events = [e.what for e in engine_server.events]
    assert events.index("generated") < events.index("pause")  # the request finished on the old weights first


def test_signal_by_file_touch(tmp_path):
    marker = tmp_path / "boundary"
    boundary = Signal(file=str(marker), sigusr1=False, interval=0.02)
    try:
        t, out = in_thread(lambda: boundary.wait(None, threading.Event()))
        time.sleep(0.2)
        assert t.is_alive()
        marker.write_text("now")
        t.join(5)
        assert out == [True]
    finally:
        boundary.close()


def test_signal_by_sigusr1():
    before = signal.getsignal(signal.SIGUSR1)
    boundary = Signal(interval=0.02)
    try:
        t, out = in_thread(lambda: boundary.wait(None, threading.Event()))
        time.sleep(0.1)
        assert t.is_alive()
        os.kill(os.getpid(), signal.SIGUSR1)
        t.join(5)
        assert out == [True]
    finally:
        boundary.close()
    assert signal.getsignal(signal.SIGUSR1) == before  # close() restores the previous handler


def test_signal_by_http_post_on_loopback():
    boundary = Signal(sigusr1=False, port=0, interval=0.02)
    try:
        t, out = in_thread(lambda: boundary.wait(None, threading.Event()))
        time.sleep(0.1)
        assert t.is_alive()
        assert requests.post(f"http://127.0.0.1:{boundary.port}/boundary").json() == {"status": "ok"}
        t.join(5)
        assert out == [True]
        assert requests.post(f"http://127.0.0.1:{boundary.port}/other").status_code == 404
    finally:
        boundary.close()


def test_a_signal_from_before_the_wait_does_not_count():
    boundary = Signal(sigusr1=False, interval=0.02)
    boundary.trigger()  # an old "boundary now", e.g. from the previous task
    stop = threading.Event()
    t, out = in_thread(lambda: boundary.wait(None, stop))
    time.sleep(0.2)
    assert t.is_alive()
    stop.set()
    t.join(5)
    assert out == [False]


def test_signal_boundary_holds_the_switch_until_told(trainer, tmp_path, engine_server):
    trainer.push()
    boundary = Signal(sigusr1=False, port=0, interval=0.02)
    sub = Subscriber(trainer.store, str(tmp_path / "dest"), SGLangEngine(engine_server.url), boundary=boundary,
                     host_id="h", **FAST)
    sub.start()
    t, out = in_thread(sub.sync)
    wait_until(lambda: sub.status.state == "waiting", what="version staged")
    time.sleep(0.2)
    assert engine_server.count("pause") == 0  # staged, engine untouched
    requests.post(f"http://127.0.0.1:{boundary.port}/boundary")
    t.join(10)
    assert out[0].version == 1 and engine_server.weight_version == "1"
    sub.close()


def test_unknown_boundary_is_a_usage_error():
    with pytest.raises(UsageError, match="boundary"):
        make_boundary("later")
