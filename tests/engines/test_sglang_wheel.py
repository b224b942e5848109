"""The SGLang adapter against SGLang 0.5.23's own code (tests/sglang_wheel_server.py).

The endpoint bodies, request validation, API-key middleware, the tokenizer manager's pause,
continue and update_weights_from_disk (with its shared result slot) and the scheduler's and model
runner's weight updaters are SGLang's, from the pinned wheel; only the scheduler process, the loader
and the model are stand-ins. What a user relies on: one update in flight, ever; a rollback only
after SGLang answered; a dead or restarted server reported as such; never left paused.
"""

from __future__ import annotations

import threading

import pytest
import requests
from engine_helpers import same_weights, wait_for
from sglang_wheel_server import WheelSGLang

from deltafs.engines.base import SwitchError
from deltafs.engines.sglang import EngineAuthError, SGLangEngine
from deltafs.errors import EngineError
from deltafs.watch.boundary import Idle


def wait_for_slow(cond) -> None:
    """wait_for with this file's longer deadline and poll interval."""
    wait_for(cond, timeout=15.0, interval=0.02)


def fast_engine(url: str, **kw) -> SGLangEngine:
    kw.setdefault("timeout", 2)
    kw.setdefault("load_timeout", 10)
    return SGLangEngine(url, poll_interval=0.1, **kw)


@pytest.fixture()
def server(ckpts):
    with WheelSGLang(ckpts[0].path, weight_version="1") as srv:
        yield srv


def test_switch_runs_through_sglangs_own_update_path(server, ckpts):
    v1, _, v2, w2 = ckpts
    engine = fast_engine(server.url)
    result = engine.switch(v2, v1)
    info = engine.model_info()
    assert (info["weight_version"], info["model_path"]) == ("2", v2.path)
    assert same_weights(server.state_dict(), w2) and not server.paused
    assert server.count("update") == 1 and not server.deaths
    assert [e.detail["flush_cache"] for e in server.events if e.what == "update"] == [True]
    assert 0 < result.load_seconds <= result.pause_seconds


def test_slow_load_is_waited_out_with_a_single_update(server, ckpts):
    v1, _, v2, w2 = ckpts
    server.inject("slow", seconds=1.0)
    result = fast_engine(server.url, load_timeout=20).switch(v2, v1)
    assert result.load_seconds >= 1.0
    assert server.count("update") == 1 and not server.deaths
    assert same_weights(server.state_dict(), w2) and not server.paused


def test_sglang_itself_breaks_on_a_second_update_while_paused(server, ckpts):
    """Why the adapter never overlaps updates: SGLang skips its update lock while paused (#33698)."""
    v1, _, v2, _ = ckpts
    server.inject("slow", seconds=0.8)
    requests.post(server.url + "/pause_generation", json={"mode": "retract"}, timeout=5)
    answers: list = []

    def update(path: str, version: str) -> None:
        try:
            answers.append(requests.post(server.url + "/update_weights_from_disk",
                                         json={"model_path": path, "weight_version": version}, timeout=10).json())
        except requests.RequestException as exc:
            answers.append(exc)

    first = threading.Thread(target=update, args=(v2.path, "2"))
    first.start()
    wait_for_slow(lambda: server.count("update") == 1)
    update(v1.path, "1")  # a "rollback" while the first load still runs
    first.join(15)
    assert server.deaths and "handle loop crashed" in server.deaths[0]
    assert not server.alive


def test_load_past_the_deadline_sends_nothing_more_and_resumes(server, ckpts):
    v1, _, v2, w2 = ckpts
    server.inject("slow", seconds=2.0)
    engine = fast_engine(server.url, load_timeout=0.5)
    with pytest.raises(SwitchError, match="no rollback was sent") as info:
        engine.switch(v2, v1)
    assert not info.value.rolled_back and info.value.serving is None
    assert not server.paused and server.count("update") == 1
    with pytest.raises(SwitchError, match="still unanswered"):
        engine.switch(v1, v2)
    assert server.count("update") == 1
    wait_for_slow(lambda: server.count("update_done") == 1)
    wait_for_slow(lambda: not server.scheduler.paused)  # it took continue_generation after the load
    results: list = []

    def try_again() -> bool:
        try:
            results.append(engine.switch(v2, v1))
            return True
        except SwitchError as exc:
            assert "still unanswered" in str(exc)
            return False

    wait_for_slow(try_again)  # once SGLang has answered, its late success is adopted: nothing is reloaded
    assert results[0].version == "2" and server.count("update") == 1
    assert engine.served_version() == "2" and same_weights(server.state_dict(), w2)
    engine.switch(v1, v2)  # the next switch goes through as usual
    assert engine.served_version() == "1" and server.count("update") == 2 and not server.deaths


def test_in_place_pause_loads_without_a_cache_flush(server, ckpts):
    v1, _, v2, w2 = ckpts
    server.scheduler.running = 2  # requests stay in the running batch under in_place
    fast_engine(server.url, pause_mode="in_place").switch(v2, v1)
    assert [e.detail["flush_cache"] for e in server.events if e.what == "update"] == [False]
    assert same_weights(server.state_dict(), w2) and server.scheduler.running == 2


def test_in_place_with_flush_is_refused_by_sglang_after_swapping(server, ckpts):
    """What a flush under in_place does in SGLang: 400, with the new weights already loaded."""
    _, _, v2, w2 = ckpts
    server.scheduler.running = 1
    requests.post(server.url + "/pause_generation", json={"mode": "in_place"}, timeout=5)
    resp = requests.post(server.url + "/update_weights_from_disk",
                         json={"model_path": v2.path, "weight_version": "2", "flush_cache": True}, timeout=10)
    assert resp.status_code == 400 and "cache was not flushed" in resp.json()["message"]
    assert same_weights(server.state_dict(), w2)
    assert requests.get(server.url + "/model_info", timeout=5).json()["weight_version"] == "1"


def test_failed_load_is_rolled_back_only_after_sglang_answered(server, ckpts):
    v1, w1, v2, _ = ckpts
    # SGLang's own recovery re-reads the NEW path after a half-way failure: it answers 400 holding v2.
    server.inject("fail_halfway")
    engine = fast_engine(server.url)
    with pytest.raises(SwitchError, match="serving version 1 again") as info:
        engine.switch(v2, v1)
    assert info.value.rolled_back
    updates = [e for e in server.events if e.what in ("update", "update_done")]
    assert [e.what for e in updates] == ["update", "update_done", "update", "update_done"]
    assert engine.served_version() == "1" and same_weights(server.state_dict(), w1)
    assert not server.paused and not server.deaths


def test_server_dying_in_its_recovery_is_reported_as_death(server, ckpts):
    v1, _, v2, _ = ckpts
    server.inject("fail_halfway_always")  # the recovery's re-read fails too: SGLang's scheduler crashes
    engine = fast_engine(server.url, timeout=1)
    with pytest.raises(SwitchError, match="died during the load") as info:
        engine.switch(v2, v1)
    assert not info.value.rolled_back and info.value.serving is None
    assert "again" not in str(info.value) and server.count("update") == 1


def test_restart_mid_switch_is_reported_with_what_it_serves_now(server, ckpts):
    v1, _, v2, _ = ckpts
    server.inject("slow", seconds=1.0)
    engine = fast_engine(server.url, timeout=3)
    def restart_once_loading() -> None:
        wait_for_slow(lambda: server.count("update") == 1)
        server.restart()

    threading.Thread(target=restart_once_loading, daemon=True).start()
    with pytest.raises(SwitchError, match="restarted during the load of version 2; it now serves weight_version '1'") as info:
        engine.switch(v2, v1)
    assert not info.value.rolled_back
    assert engine.served_version() == "1" and not server.paused


def test_unknown_fields_or_wrong_types_would_be_422_and_ours_are_not(server, ckpts):
    _, _, v2, _ = ckpts
    bad = requests.post(server.url + "/update_weights_from_disk", json={"model_path": v2.path, "weight_version": 2})
    assert bad.status_code == 422
    assert requests.post(server.url + "/update_weights_from_disk").status_code == 422


def test_two_keys_each_where_sglang_wants_it(ckpts):
    v1, _, v2, w2 = ckpts
    with WheelSGLang(v1.path, weight_version="1", api_key="user-key", admin_api_key="admin-key") as srv:
        both = fast_engine(srv.url, api_key="user-key", admin_api_key="admin-key")
        assert both.busy_requests() == 0
        both.switch(v2, v1)
        assert both.served_version() == "2" and same_weights(srv.state_dict(), w2)

        user_only = fast_engine(srv.url, api_key="user-key")
        with pytest.raises(SwitchError, match="DELTAFS_ENGINE_ADMIN_API_KEY") as info:
            user_only.switch(v1, v2)
        assert "HTTP 401" in str(info.value) and srv.count("update") == 1 and not srv.paused

        with pytest.raises(EngineAuthError, match="DELTAFS_ENGINE_API_KEY does not match"):
            fast_engine(srv.url, api_key="wrong", admin_api_key="admin-key").served_version()
        with pytest.raises(EngineAuthError, match="set DELTAFS_ENGINE_API_KEY"):
            fast_engine(srv.url, admin_api_key="admin-key").busy_requests()


def test_admin_key_alone_guards_only_the_admin_endpoints(ckpts):
    v1, _, v2, _ = ckpts
    with WheelSGLang(v1.path, weight_version="1", admin_api_key="admin-key") as srv:
        assert fast_engine(srv.url).served_version() == "1"  # /model_info is open
        with pytest.raises(SwitchError, match="set DELTAFS_ENGINE_ADMIN_API_KEY"):
            fast_engine(srv.url).switch(v2, v1)
        fast_engine(srv.url, admin_api_key="admin-key").switch(v2, v1)
        assert fast_engine(srv.url).served_version() == "2"


@pytest.mark.parametrize("how", ["401", "404"])
def test_idle_boundary_never_reads_an_error_as_idle(ckpts, how):
    v1 = ckpts[0]
    with WheelSGLang(v1.path, weight_version="1", api_key="user-key") as srv:
        engine = fast_engine(srv.url) if how == "401" else fast_engine(srv.url + "/nowhere", api_key="user-key")
        with pytest.raises(EngineError, match="load could not be read"):
            Idle(max_wait=0.3, interval=0.05).wait(engine, threading.Event())


def test_several_tokenizer_workers_do_not_cause_a_false_rollback(ckpts):
    v1, _, v2, w2 = ckpts
    with WheelSGLang(v1.path, weight_version="1", tokenizer_workers=2) as srv:
        engine = fast_engine(srv.url)
        engine.switch(v2, v1)
        assert srv.count("update") == 1 and same_weights(srv.state_dict(), w2)
        # SGLang keeps weight_version per worker process: the other one still says "1".
        assert sorted(srv.reported_versions()) == ["1", "2"]


def test_loaded_weight_checksum_follows_the_weights(ckpts):
    v1, _, v2, _ = ckpts
    with WheelSGLang(v1.path, weight_version="1") as a, WheelSGLang(v1.path, weight_version="1") as b:
        ea, eb = fast_engine(a.url), fast_engine(b.url)
        first = ea.loaded_checksum()
        assert first and first == eb.loaded_checksum()
        ea.switch(v2, v1)
        assert ea.loaded_checksum() not in (None, first)
