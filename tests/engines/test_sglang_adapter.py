"""The SGLang adapter against the named stand-in server (tests/sglang_standin.py).

What a user relies on: after switch() the engine reports the new weight_version and holds exactly
the new weights; after any failure it serves the previous verified version again; in no case is it
left paused.
"""

from __future__ import annotations

import threading

import pytest
import requests
from engine_helpers import same_weights, wait_for
from sglang_standin import StandinSGLang

from deltafs.engines.base import SwitchError, Target
from deltafs.engines.sglang import SGLangEngine
from deltafs.errors import EngineError, UsageError


@pytest.fixture()
def server(ckpts):
    with StandinSGLang(ckpts[0].path) as srv:
        engine = SGLangEngine(srv.url, timeout=5, load_timeout=5)
        engine.switch(ckpts[0], None)  # the engine starts out serving version "1"
        yield srv


def test_switch_loads_new_weights_and_reports_version(server, ckpts):
    v1, _, v2, w2 = ckpts
    engine = SGLangEngine(server.url)
    result = engine.switch(v2, v1)
    assert result.version == "2" and engine.served_version() == "2"
    assert same_weights(server.state_dict(), w2)
    assert not server.paused
    assert [e.what for e in server.events[-4:]] == ["pause", "update", "loaded", "continue"]
    assert server.events[-4].detail["mode"] == "retract"
    assert 0 < result.load_seconds <= result.pause_seconds


@pytest.mark.parametrize("fault", ["http500", "success_false", "wrong_version"])
def test_failed_switch_rolls_back_and_resumes(server, ckpts, fault):
    v1, w1, v2, _ = ckpts
    engine = SGLangEngine(server.url)
    server.inject(fault)
    with pytest.raises(SwitchError) as info:
        engine.switch(v2, v1)
    assert info.value.rolled_back and "serving version 1 again" in str(info.value)
    assert engine.served_version() == "1"
    assert same_weights(server.state_dict(), w1)
    assert not server.paused
    # The fault cleared: the next attempt goes through.
    engine.switch(v2, v1)
    assert engine.served_version() == "2"


def test_slow_load_within_timeout_succeeds_and_pause_covers_it(server, ckpts):
    v1, _, v2, w2 = ckpts
    engine = SGLangEngine(server.url, load_timeout=5)
    server.inject("slow", seconds=0.4)
    result = engine.switch(v2, v1)
    assert result.pause_seconds >= 0.4
    assert same_weights(server.state_dict(), w2)


def test_unloadable_checkpoint_is_refused_and_rolled_back(server, ckpts, tmp_path):
    v1, w1, _, _ = ckpts
    bad = tmp_path / "broken"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    engine = SGLangEngine(server.url)
    with pytest.raises(SwitchError, match="HTTP 400"):
        engine.switch(Target(str(bad), "3"), v1)
    assert engine.served_version() == "1"
    assert same_weights(server.state_dict(), w1)


def test_requests_wait_during_the_switch_and_see_the_new_version(ckpts):
    v1, _, v2, w2 = ckpts
    with StandinSGLang(v1.path, token_delay=0.01) as server:
        engine = SGLangEngine(server.url)
        engine.switch(v1, None)
        server.inject("slow", seconds=0.5)
        answers: list[dict] = []
        switcher = threading.Thread(target=engine.switch, args=(v2, v1))
        switcher.start()
        wait_for(lambda: server.paused)
        answers.append(requests.post(server.url + "/generate", json={"input_ids": [1, 2, 3],
                                                                      "sampling_params": {"max_new_tokens": 4}}).json())
        switcher.join()
        meta = answers[0]["meta_info"]
        assert meta["weight_version"] == "2"
        assert answers[0]["output_ids"] == server.generate_ids([1, 2, 3], 4)
        assert same_weights(server.state_dict(), w2)


def test_busy_requests_counts_running_generation(ckpts):
    v1 = ckpts[0]
    with StandinSGLang(v1.path, token_delay=0.05) as server:
        engine = SGLangEngine(server.url)
        assert engine.busy_requests() == 0
        worker = threading.Thread(target=requests.post, args=(server.url + "/generate",),
                                  kwargs={"json": {"text": "hi", "sampling_params": {"max_new_tokens": 10}}})
        worker.start()
        wait_for(lambda: engine.busy_requests() == 1)
        worker.join()
        assert engine.busy_requests() == 0


def test_resume_refused_by_the_engine_says_it_may_still_be_paused(server, ckpts):
    engine = SGLangEngine(server.url, resume_attempts=2)
    engine.url = server.url + "/no-such-prefix"  # every call answers 404
    with pytest.raises(EngineError, match="may still be paused"):
        engine.resume()


def test_unknown_pause_mode_is_a_usage_error():
    with pytest.raises(UsageError, match="pause mode"):
        SGLangEngine("http://127.0.0.1:1", pause_mode="stop")


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_mode_is_sent(server, ckpts, mode):
    v1, _, v2, _ = ckpts
    SGLangEngine(server.url, pause_mode=mode).switch(v2, v1)
    assert [e.detail["mode"] for e in server.events if e.what == "pause"][-1] == mode


@pytest.mark.parametrize("bad", [None, "abc", -1, 1.5, True])
def test_a_load_that_is_not_a_count_is_an_engine_error_not_idle(ckpts, monkeypatch, bad):
    """A /v1/loads entry whose count is null, text, negative or fractional: EngineError (the idle boundary keeps
    waiting), not a TypeError that ends the watcher."""
    with StandinSGLang(ckpts[0].path) as srv:
        real = srv.loads

        def damaged() -> dict:
            out = real()
            out["loads"][0]["num_waiting_reqs"] = bad
            return out

        monkeypatch.setattr(srv, "loads", damaged)
        with pytest.raises(EngineError, match="num_waiting_reqs .* not a count"):
            SGLangEngine(srv.url).busy_requests()


def test_a_huge_loaded_weight_checksum_is_kept_as_its_digest():
    """The ledger rewrites the engine's checksum at every heartbeat: megabytes of it are kept as a sha256."""
    from deltafs.engines.switch import CHECKSUM_MAX_CHARS, loaded_checksum

    class Engine:
        def __init__(self, value: object) -> None:
            self.value = value

        def loaded_checksum(self) -> object:
            return self.value

    assert loaded_checksum(Engine("ab" * 10)) == "ab" * 10
    huge = "f" * (CHECKSUM_MAX_CHARS + 1)
    kept = loaded_checksum(Engine(huge))
    assert kept is not None and kept.startswith("sha256:") and len(kept) == 71
    assert kept == loaded_checksum(Engine(huge)) != loaded_checksum(Engine(huge[:-1] + "e"))


def test_a_weight_version_reported_as_a_number_is_the_same_version(monkeypatch):
    """An engine answering weight_version 3 (not "3") after loading "3" was called a failed load, and a good
    rollback a failed one (adversarial pass): both reads compare text."""
    engine = SGLangEngine("http://127.0.0.1:1")
    monkeypatch.setattr(engine, "model_info", lambda fresh=False: {"weight_version": 3, "model_path": "/m"})
    assert engine.served_version() == "3"
    engine._confirm(Target("/m", "3"))  # no _Refused


def test_a_check_that_fails_after_a_successful_update_says_so_and_sends_no_rollback(server, ckpts, monkeypatch):
    """/model_info breaking right after SGLang answered the update with success read only "switch failed: GET
    /model_info ...": the message now says the update succeeded, that the engine most likely holds it and that no
    rollback was sent; the engine is resumed."""
    v1, _, v2, _ = ckpts
    engine = SGLangEngine(server.url, timeout=5, load_timeout=5)

    def broken(target):
        raise EngineError("GET /model_info answered HTTP 500: boom")

    monkeypatch.setattr(engine, "_confirm", broken)
    updates = server.count("update")
    with pytest.raises(SwitchError, match=r"answered the update to version 2 with success, but what it serves could "
                                          r"not be read: .*boom; no rollback was sent") as info:
        engine.switch(v2, v1)
    assert server.count("update") == updates + 1 and not server.paused
    assert not info.value.rolled_back
