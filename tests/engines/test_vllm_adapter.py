"""The vLLM adapter against vLLM 0.33's own route handlers, run around the stand-in engine (vllm_standin.py).

What a user relies on: after switch() the engine reports the new weight_version and holds exactly
the new weights; after any failure it serves the previous verified version again, or says that its
weights are unknown; in no case is it left paused.
"""

from __future__ import annotations

import threading

import pytest
import requests
import torch
from engine_helpers import same_weights, wait_for
from sglang_standin import tiny_config, write_checkpoint
from vllm_standin import StandinVLLM

from deltafs.engines import make_engine, reload_engine
from deltafs.engines.base import Engine, SwitchError, Target
from deltafs.engines.vllm import LOADING_PREFIX, VLLMEngine
from deltafs.errors import EngineError, UsageError

CONFIG = tiny_config()


@pytest.fixture()
def server(ckpts):
    with StandinVLLM(ckpts[0].path) as srv:
        VLLMEngine(srv.url, timeout=5, load_timeout=5).switch(ckpts[0], None)  # serving version "1"
        yield srv


def test_switch_reloads_in_place_labels_and_resumes(server, ckpts):
    v1, _, v2, w2 = ckpts
    engine = VLLMEngine(server.url)
    assert isinstance(engine, Engine) and make_engine("vllm", server.url).kind == "vllm"
    result = engine.switch(v2, v1)
    assert result.version == "2" and engine.served_version() == "2"
    assert same_weights(server.state_dict(), w2)
    assert not server.paused
    events = [(e.what, e.detail) for e in server.events[-7:]]
    assert events == [
        ("pause", {"mode": "keep", "clear_cache": True}),
        ("label", {"version": LOADING_PREFIX + "2"}),
        ("rpc", {"method": "reload_weights", "kwargs": {"weights_path": v2.path}}),
        ("reload", {"weights_path": v2.path, "fault": None}),
        ("reloaded", {"weights_path": v2.path}),
        ("label", {"version": "2"}),
        ("resume", {}),
    ]
    assert 0 < result.load_seconds <= result.pause_seconds


def test_a_fresh_engine_reports_vllms_default_label(ckpts):
    with StandinVLLM(ckpts[0].path) as srv:
        assert VLLMEngine(srv.url).served_version() == "default"


@pytest.mark.parametrize("fault", ["error", "midway"])
def test_failed_reload_rolls_back_and_resumes(server, ckpts, fault):
    v1, w1, v2, w2 = ckpts
    engine = VLLMEngine(server.url)
    server.inject(fault)
    with pytest.raises(SwitchError) as info:
        engine.switch(v2, v1)
    message = str(info.value)
    assert info.value.rolled_back and info.value.serving == v1
    assert "reload_weights from" in message and "HTTP 500" in message and message.endswith("serving version 1 again")
    assert "\n" not in message
    assert engine.served_version() == "1"
    assert same_weights(server.state_dict(), w1)
    assert not server.paused
    engine.switch(v2, v1)  # the fault cleared: the next attempt goes through
    assert engine.served_version() == "2" and same_weights(server.state_dict(), w2)


def test_half_done_reload_without_a_previous_version_is_never_labelled_as_one(server, ckpts):
    v1, w1, v2, w2 = ckpts
    engine = VLLMEngine(server.url)
    server.inject("midway")
    with pytest.raises(SwitchError, match="partly replaced") as info:
        engine.switch(v2, None)
    assert not info.value.rolled_back and info.value.serving is None
    # vLLM reloads in place: the weights are a mix of both versions, and the label says so.
    live = server.state_dict()
    assert not same_weights(live, w1) and not same_weights(live, w2)
    assert engine.served_version() == LOADING_PREFIX + "2"
    assert not server.paused
    # reload_engine sees a version that is not the wanted one and switches (no rollback target).
    assert reload_engine("vllm", server.url, v2.path, 2) is not None
    assert same_weights(server.state_dict(), w2)


def test_failed_rollback_says_the_previous_version_is_not_confirmed(server, ckpts):
    v1, _, v2, _ = ckpts
    engine = VLLMEngine(server.url)
    server.inject("error", count=2)
    with pytest.raises(SwitchError, match="could not confirm the previous version is back") as info:
        engine.switch(v2, v1)
    assert not info.value.rolled_back and info.value.serving is None
    assert engine.served_version() == LOADING_PREFIX + "1"  # the rollback's own reload failed
    assert not server.paused


def test_verified_rollback_compares_vllms_checksums_with_those_before_the_switch(server, ckpts):
    v1, w1, v2, _ = ckpts
    engine = VLLMEngine(server.url, verify_rollback=True)
    engine.switch(v2, v1)  # a switch that works takes one baseline and nothing more
    assert server.count("checksums") == 1
    server.inject("midway")
    with pytest.raises(SwitchError, match="serving version 2 again") as info:
        engine.switch(v1, v2)
    assert info.value.rolled_back and server.count("checksums") == 3  # baseline, then the compare
    assert engine.served_version() == "2" and not server.paused


def test_verified_rollback_catches_tensors_vllm_silently_kept(server, ckpts, tmp_path):
    v1, w1, v2, w2 = ckpts
    # vLLM's reload keeps the old value of a tensor the directory lacks (it only logs a warning):
    # a previous directory that lost lm_head.weight reloads "successfully" but not to version 1.
    partial = {k: v for k, v in w1.items() if k != "lm_head.weight"}
    bad_v1 = Target(write_checkpoint(str(tmp_path / "v1-partial"), partial, CONFIG), "1")
    engine = VLLMEngine(server.url, verify_rollback=True)
    server.inject("midway")  # sorted names: lm_head.weight is among the first half, so it changes
    with pytest.raises(SwitchError) as info:
        engine.switch(v2, bad_v1)
    message = str(info.value)
    assert not info.value.rolled_back and info.value.serving is None
    assert message.endswith("could not confirm the previous version is back")
    assert not torch.equal(server.state_dict()["lm_head.weight"], w1["lm_head.weight"])
    assert engine.served_version() == LOADING_PREFIX + "1"  # the label claims nothing
    assert not server.paused


def test_hanging_reload_times_out_and_rolls_back(server, ckpts):
    v1, w1, v2, _ = ckpts
    # The hung reload times out after 1 s; vLLM runs utility calls one at a time, so the rollback's
    # calls wait for it, then load version 1 within their own timeouts.
    engine = VLLMEngine(server.url, load_timeout=1.0)
    server.inject("hang", seconds=1.5)
    with pytest.raises(SwitchError, match="timed out") as info:
        engine.switch(v2, v1)
    assert info.value.rolled_back
    assert engine.served_version() == "1"
    assert same_weights(server.state_dict(), w1)
    assert not server.paused


def test_unloadable_checkpoint_is_refused_and_rolled_back(server, ckpts, tmp_path):
    v1, w1, _, _ = ckpts
    empty = tmp_path / "empty"
    empty.mkdir()
    engine = VLLMEngine(server.url)
    with pytest.raises(SwitchError, match="Cannot find any model weights"):
        engine.switch(Target(str(empty), "3"), v1)
    assert engine.served_version() == "1" and same_weights(server.state_dict(), w1)


def test_server_without_dev_mode_is_named_as_the_problem(ckpts):
    v1, _, v2, w2 = ckpts
    with StandinVLLM(v1.path, dev_mode=False) as srv:
        engine = VLLMEngine(srv.url, resume_attempts=1)
        with pytest.raises(EngineError, match="has no /weight_info route: start it with VLLM_SERVER_DEV_MODE=1"):
            engine.served_version()
        with pytest.raises(SwitchError, match="has no /pause route: start it with VLLM_SERVER_DEV_MODE=1"):
            engine.switch(v2, v1)
        assert srv.count("reload") == 0


def test_api_key_server_accepts_the_adapter(ckpts):
    v1, _, v2, w2 = ckpts
    with StandinVLLM(v1.path, api_key="s3cret") as srv:
        assert requests.get(srv.url + "/v1/models").status_code == 401  # vLLM's middleware is live
        engine = VLLMEngine(srv.url, api_key="s3cret")
        engine.switch(v2, v1)
        assert engine.served_version() == "2" and same_weights(srv.state_dict(), w2)
        # vLLM guards /v1/... only: the development routes answer without the key too.
        assert VLLMEngine(srv.url).served_version() == "2"


def test_requests_queue_during_a_keep_pause_and_run_on_the_new_weights(ckpts):
    v1, _, v2, w2 = ckpts
    with StandinVLLM(v1.path) as server:
        engine = VLLMEngine(server.url)
        engine.switch(v1, None)
        server.inject("slow", seconds=0.5)
        switcher = threading.Thread(target=engine.switch, args=(v2, v1))
        switcher.start()
        wait_for(lambda: server.paused)
        answer = requests.post(server.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}).json()
        switcher.join()
        assert answer["weight_version"] == "2"
        assert answer["choices"][0]["token_ids"] == server.generate_ids([1, 2, 3], 4)
        assert same_weights(server.state_dict(), w2)


@pytest.mark.parametrize("mode, sent", [("abort", "abort"), ("wait", "wait"), ("keep", "keep"), ("retract", "keep")])
def test_pause_mode_is_sent_as_vllms_query_parameter(server, ckpts, mode, sent):
    v1, _, v2, _ = ckpts
    VLLMEngine(server.url, pause_mode=mode).switch(v2, v1)
    assert [e.detail for e in server.events if e.what == "pause"][-1] == {"mode": sent, "clear_cache": True}


def test_unknown_pause_mode_is_a_usage_error():
    with pytest.raises(UsageError, match="unknown pause mode 'in_place' for vLLM; use one of abort, wait, keep"):
        VLLMEngine("http://127.0.0.1:1", pause_mode="in_place")


def test_busy_requests_sums_vllms_scheduler_gauges(server):
    engine = VLLMEngine(server.url)
    assert engine.busy_requests() == 0
    server.running, server.waiting = 2, 3
    assert engine.busy_requests() == 5  # waiting_by_reason is a different metric
    server.stop()
    with pytest.raises(EngineError):  # an error is never "idle" (refused, or reset while the server shuts down)
        engine.busy_requests()


def test_busy_requests_that_cannot_be_read_raise_and_missing_gauges_mean_no_load(server, monkeypatch):
    """/metrics answering an error is not idle (the idle boundary waits); no gauges at all is no notion of load."""
    engine = VLLMEngine(server.url)
    monkeypatch.setattr(server, "metrics_text", lambda: (_ for _ in ()).throw(RuntimeError("injected")))
    with pytest.raises(EngineError, match="GET /metrics answered HTTP 500"):
        engine.busy_requests()
    monkeypatch.setattr(server, "metrics_text", lambda: "# HELP other\nother_metric 1\n")
    # A new client: the server may close the connection that carried its 500, and a request that finds it closed
    # a moment too late fails as unreachable (a race of the test's, not of the adapter's answer).
    assert VLLMEngine(server.url).busy_requests() is None


def test_resume_is_retried_then_says_the_engine_may_still_be_paused(server):
    requests.post(server.url + "/pause", params={"mode": "keep"})
    server.resume_failures = 1
    VLLMEngine(server.url, resume_attempts=2).resume()  # the second attempt works
    assert not server.paused
    requests.post(server.url + "/pause", params={"mode": "keep"})
    server.resume_failures = 2
    with pytest.raises(EngineError, match=r"may still be paused: POST /resume answered HTTP 500: .*injected resume"):
        VLLMEngine(server.url, resume_attempts=2).resume()
    assert server.paused


def test_switch_whose_resume_fails_reports_the_loaded_version_and_the_pause(server, ckpts):
    v1, _, v2, w2 = ckpts
    engine = VLLMEngine(server.url, resume_attempts=2)
    server.resume_failures = 2
    with pytest.raises(SwitchError, match="it holds the new version but may still be paused") as info:
        engine.switch(v2, v1)
    assert info.value.serving == v2 and not info.value.rolled_back
    assert same_weights(server.state_dict(), w2) and server.paused
    engine.resume()  # what the watcher does on its next start or retry
    assert not server.paused


def test_a_server_without_dev_routes_is_not_retried_as_paused(ckpts):
    with StandinVLLM(ckpts[0].path, dev_mode=False) as srv:
        with pytest.raises(EngineError, match="has no /resume route"):
            VLLMEngine(srv.url, resume_attempts=4).resume()


def test_make_engine_needs_a_url():
    with pytest.raises(UsageError, match=r"--engine vllm needs --engine-url \(e.g. http://127.0.0.1:8000\)"):
        make_engine("vllm", None)
