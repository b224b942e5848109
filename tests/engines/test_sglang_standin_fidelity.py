"""The named stand-in (tests/sglang_standin.py) answers like SGLang's own code does, and is not more lenient.

Each request goes to both the stand-in and SGLang 0.5.23's endpoint code (tests/sglang_wheel_server.py);
status codes and body shapes must agree. Generation, which only the stand-in has, is checked on its own:
abort ends requests in flight, retract/in_place hold them between tokens, spans name both versions.
"""

from __future__ import annotations

import threading
import time

import pytest
import requests
from sglang_standin import StandinSGLang, random_weights, tiny_config, write_checkpoint
from sglang_wheel_server import WheelSGLang

CONFIG = tiny_config()


@pytest.fixture()
def both(tmp_path):
    v1 = write_checkpoint(str(tmp_path / "v1"), random_weights(CONFIG, 1), CONFIG)
    v2 = write_checkpoint(str(tmp_path / "v2"), random_weights(CONFIG, 2), CONFIG)
    with StandinSGLang(v1) as standin, WheelSGLang(v1) as own:
        yield standin, own, v2


def ask(url: str, method: str, route: str, **kw) -> requests.Response:
    return requests.request(method, url + route, timeout=10, **kw)


CASES = [
    ("GET", "/health", {}),
    ("GET", "/no-such-route", {}),
    ("POST", "/update_weights_from_disk", {}),  # no body at all
    ("POST", "/update_weights_from_disk", {"json": {"weight_version": "2"}}),  # model_path missing
    ("POST", "/pause_generation", {"json": {"mode": "stop"}}),
    ("POST", "/pause_generation", {"json": {"mode": "retract"}}),
    ("POST", "/continue_generation", {"json": {}}),
    ("POST", "/continue_generation", {}),
]


@pytest.mark.parametrize("method, route, kw", CASES)
def test_same_status_and_body_shape(both, method, route, kw):
    standin, own, _ = both
    a, b = ask(standin.url, method, route, **kw), ask(own.url, method, route, **kw)
    assert a.status_code == b.status_code
    if b.content:
        body_a, body_b = a.json(), b.json()
        assert type(body_a) is type(body_b)
        if isinstance(body_b, dict):
            assert set(body_a) == set(body_b)
    else:
        assert not a.content


def test_integer_weight_version_is_refused_by_both(both):
    standin, own, v2 = both
    body = {"model_path": v2, "weight_version": 2}
    assert ask(standin.url, "POST", "/update_weights_from_disk", json=body).status_code == 422
    assert ask(own.url, "POST", "/update_weights_from_disk", json=body).status_code == 422


def test_update_and_model_info_answer_alike(both):
    standin, own, v2 = both
    body = {"model_path": v2, "weight_version": "2"}
    a, b = (ask(u, "POST", "/update_weights_from_disk", json=body) for u in (standin.url, own.url))
    assert a.status_code == b.status_code == 200 and set(a.json()) == set(b.json())
    info_a, info_b = (ask(u, "GET", "/model_info").json() for u in (standin.url, own.url))
    assert set(info_a) == set(info_b)
    assert (info_a["weight_version"], info_a["model_path"]) == (info_b["weight_version"], info_b["model_path"]) == ("2", v2)


def generate_in_thread(url: str, tokens: int) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(requests.post(
        url + "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": tokens}}, timeout=30).json()))
    t.start()
    return t, out


def test_abort_pause_ends_requests_in_flight(tmp_path):
    v1 = write_checkpoint(str(tmp_path / "v1"), random_weights(CONFIG, 1), CONFIG)
    with StandinSGLang(v1, token_delay=0.05) as srv:
        t, out = generate_in_thread(srv.url, 40)
        deadline = time.monotonic() + 10
        while srv.running == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        requests.post(srv.url + "/pause_generation", json={"mode": "abort"}, timeout=5)
        t.join(10)
        meta = out[0]["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 40
        requests.post(srv.url + "/continue_generation", json={}, timeout=5)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_paused_requests_hold_and_report_both_versions_as_spans(tmp_path, mode):
    v1 = write_checkpoint(str(tmp_path / "v1"), random_weights(CONFIG, 1), CONFIG)
    v2 = write_checkpoint(str(tmp_path / "v2"), random_weights(CONFIG, 2), CONFIG)
    with StandinSGLang(v1, token_delay=0.05) as srv:
        srv.weight_version = "1"
        t, out = generate_in_thread(srv.url, 12)
        deadline = time.monotonic() + 10
        while srv.running == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.15)
        requests.post(srv.url + "/pause_generation", json={"mode": mode}, timeout=5)
        time.sleep(0.3)
        assert t.is_alive()  # held, not finished and not aborted
        requests.post(srv.url + "/update_weights_from_disk", json={"model_path": v2, "weight_version": "2"}, timeout=10)
        requests.post(srv.url + "/continue_generation", json={}, timeout=5)
        t.join(20)
        meta = out[0]["meta_info"]
        assert meta["completion_tokens"] == 12 and meta["weight_version"] == "2"
        spans = meta["weight_versions"]
        assert [s["version"] for s in spans] == ["1", "2"] and spans[-1]["end"] == 12
        assert spans[0]["end"] == spans[1]["start"] > 0
