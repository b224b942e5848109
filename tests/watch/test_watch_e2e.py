"""A watcher running beside the SGLang stand-in while a trainer pushes versions.

Real parts: the store on disk, push and pull, the stand-in HTTP server loading the safetensors into a
torch model, inotify events. What a user relies on: the engine ends at the newest version with
weights bit-identical to what was pushed, failures end on a verified version, never paused.
"""

from __future__ import annotations

import logging
import os

import pytest
from watch_helpers import FAST, running, same_weights, wait_until

from deltafs.engines.base import SwitchError
from deltafs.engines.sglang import SGLangEngine
from deltafs.store.open import open_objects
from deltafs.watch import Subscriber
from deltafs.watch.ledger import HostStatus, ledger_key


def subscriber(trainer, tmp_path, server, **kw) -> Subscriber:
    engine = SGLangEngine(server.url, timeout=2, load_timeout=kw.pop("load_timeout", 5))
    return Subscriber(trainer.store, str(tmp_path / "dest"), engine, host_id="rollout-0", **{**FAST, **kw})


def ledger(trainer) -> HostStatus:
    return HostStatus.from_bytes(open_objects(trainer.store).get(ledger_key("rollout-0")))


def served(trainer, version: int) -> bool:
    """The watcher finished the switch to version (the engine reports it and generation resumed)."""
    try:
        status = ledger(trainer)
    except FileNotFoundError:
        return False
    return status.served_version == version and status.state in ("serving", "stopped")


def test_versions_pushed_while_watching_go_live_bit_identical(trainer, tmp_path, engine_server, caplog):
    caplog.set_level(logging.INFO, logger="deltafs")
    trainer.push()
    sub = subscriber(trainer, tmp_path, engine_server)
    with running(sub):
        wait_until(lambda: engine_server.weight_version == "1", what="version 1 live")
        for _ in range(3):
            newest = trainer.push()
            wait_until(lambda v=newest: engine_server.weight_version == str(v), what=f"version {newest} live")
        assert sub.notifier.mode == "inotify"
    assert same_weights(engine_server.state_dict(), trainer.weights[4])
    assert not engine_server.paused
    status = ledger(trainer)
    assert (status.state, status.served_version, status.failures) == ("stopped", 4, 0)
    assert status.last_sync["version"] == 4 and status.last_sync["pause_s"] > 0
    lines = [r.getMessage() for r in caplog.records if "live on" in r.getMessage()]
    assert len(lines) == 4 and "pause" in lines[-1] and "total sync" in lines[-1]


def test_a_burst_is_coalesced_to_the_newest_version(trainer, tmp_path, engine_server):
    trainer.push()
    sub = subscriber(trainer, tmp_path, engine_server)
    sub.start()
    sub.sync()
    for _ in range(3):
        trainer.push()
    updates = engine_server.count("update")
    applied = sub.sync()
    assert applied.version == 4
    assert engine_server.count("update") == updates + 1  # straight to 4, not 2 then 3 then 4
    assert same_weights(engine_server.state_dict(), trainer.weights[4])


def test_polling_mode_follows_the_store_too(trainer, tmp_path, engine_server):
    trainer.push()
    sub = subscriber(trainer, tmp_path, engine_server, poll=0.1)
    with running(sub):
        wait_until(lambda: engine_server.weight_version == "1")
        trainer.push()
        wait_until(lambda: engine_server.weight_version == "2")
        assert sub.notifier.mode == "poll"
    assert same_weights(engine_server.state_dict(), trainer.weights[2])


# A load that outlasts the deadline is not rolled back (SGLang cannot take a second update meanwhile):
# tests/watch/test_watch_sglang.py covers it against SGLang's own code.
@pytest.mark.parametrize("fault, seconds", [("http500", 0), ("success_false", 0), ("wrong_version", 0)])
def test_every_engine_failure_ends_on_a_verified_version_and_recovers(trainer, tmp_path, engine_server, fault, seconds):
    trainer.push()
    sub = subscriber(trainer, tmp_path, engine_server, load_timeout=1.0)
    with running(sub) as thread:
        wait_until(lambda: served(trainer, 1))
        engine_server.inject(fault, seconds=seconds)
        trainer.push()
        # The failed switch was rolled back to version 1, reported, then retried until it went through.
        wait_until(lambda: engine_server.count("update") >= 4, what="switch, rollback and retry")
        wait_until(lambda: engine_server.weight_version == "2", what="version 2 live after retry")
        wait_until(lambda: ledger(trainer).failures == 0 and ledger(trainer).served_version == 2, what="ledger healthy")
        assert thread.is_alive()
    versions = [e.detail["weight_version"] for e in engine_server.events if e.what == "update"]
    assert versions[:4] == ["1", "2", "1", "2"]  # load 1, failed 2, rollback to 1, retried 2
    assert same_weights(engine_server.state_dict(), trainer.weights[2])
    assert not engine_server.paused
    pauses, resumes = engine_server.count("pause"), engine_server.count("continue")
    assert resumes >= pauses


def test_engine_refusing_connections_then_coming_back(trainer, tmp_path, engine_server):
    trainer.push()
    sub = subscriber(trainer, tmp_path, engine_server)
    with running(sub) as thread:
        wait_until(lambda: served(trainer, 1))
        engine_server.stop()
        trainer.push()
        wait_until(lambda: ledger(trainer).failures >= 2, what="failures recorded")
        status = ledger(trainer)
        assert status.state == "degraded" and "cannot reach SGLang" in status.last_error
        assert status.served_version == 1 and status.staged_version == 2
        engine_server.start()
        wait_until(lambda: engine_server.weight_version == "2", what="recovery")
        wait_until(lambda: ledger(trainer).failures == 0)
        assert thread.is_alive()
    assert same_weights(engine_server.state_dict(), trainer.weights[2])
    assert not engine_server.paused


def test_watcher_started_before_the_first_push(trainer, tmp_path, engine_server):
    sub = subscriber(trainer, tmp_path, engine_server, poll=0.1)
    with running(sub):
        wait_until(lambda: engine_server.weight_version == "default" and sub.status.state == "starting")
        trainer.push()
        wait_until(lambda: engine_server.weight_version == "1", what="the first version live")
        assert sub.status.failures == 0
    assert same_weights(engine_server.state_dict(), trainer.weights[1])


def test_the_served_version_stays_on_disk_as_rollback_target(trainer, tmp_path, engine_server):
    trainer.push()
    sub = subscriber(trainer, tmp_path, engine_server)
    sub.start()
    sub.sync()
    first = sub.served.path
    for _ in range(4):  # versions staged but never switched in (the engine keeps failing)
        trainer.push()
        engine_server.inject("http500")
        with pytest.raises(SwitchError, match="serving version 1 again"):
            sub.sync()
    assert os.path.isdir(first) and sub.served.path == first
