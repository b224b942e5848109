"""The watcher never reports a host healthy while its engine is stuck, and never lets a long step make it look dead.

Each test reproduces what an adversarial pass found against SGLang 0.5.23's own update code
(tests/sglang_wheel_server.py): an engine left paused after a failed resume while the ledger said serving; a
multi-minute load that made the leader's ledger entry stale (so an engine group's followers stopped keeping the
version the engine was loading); a rollback that named a path a follower did not have; a watcher stopped while it
waited for a killed switch's load, which resumed the engine mid-load; `watch --once` failures that never reached
the ledger; SIGHUP and a stray SIGUSR1 that killed the watcher.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from sglang_wheel_server import WheelSGLang
from watch_helpers import FAST, same_weights, wait_until

from deltafs.engines.base import SwitchError, Target
from deltafs.engines.inflight import SwitchRecord
from deltafs.engines.sglang import SGLangEngine
from deltafs.errors import EngineError
from deltafs.read.pull import pull
from deltafs.store.open import open_objects
from deltafs.watch import Subscriber
from deltafs.watch.ledger import HostStatus, ledger_key

MAIN = "import sys; from deltafs.cli.main import main; sys.argv[0] = 'deltafs'; main()"


def engine(server: WheelSGLang, **kw) -> SGLangEngine:
    return SGLangEngine(server.url, timeout=2, load_timeout=kw.pop("load_timeout", 10), poll_interval=0.1,
                        resume_attempts=1, **kw)


def ledger(store: str, host: str) -> HostStatus:
    return HostStatus.from_bytes(open_objects(store).get(ledger_key(host)))


def paused(server: WheelSGLang) -> bool:
    return any(w.is_pause for w in server.workers)


@pytest.fixture()
def staged_v1(trainer, tmp_path):
    trainer.push()
    dest = str(tmp_path / "dest")
    return dest, pull(trainer.store, dest).path


def _left_paused(trainer, dest: str, server: WheelSGLang, monkeypatch) -> tuple[SGLangEngine, Subscriber]:
    """A watcher whose switch to version 2 loaded it, then could not resume generation (continue_generation: 500)."""
    eng = engine(server)
    sub = Subscriber(trainer.store, dest, eng, host_id="h", **FAST)
    sub.start()
    trainer.push()
    real = eng._resume_once

    def refused() -> None:
        raise EngineError("continue_generation answered 500")

    monkeypatch.setattr(eng, "_resume_once", refused)
    with pytest.raises(SwitchError) as info:
        sub.once()
    assert info.value.paused and paused(server)
    eng.real_resume_once = real  # type: ignore[attr-defined] - put back by the test
    return eng, sub


def test_a_failed_resume_is_tried_again_and_the_host_stays_degraded_until_it_works(trainer, staged_v1, monkeypatch):
    dest, v1_dir = staged_v1
    with WheelSGLang(v1_dir, weight_version="1") as server:
        eng, sub = _left_paused(trainer, dest, server, monkeypatch)
        real = eng.real_resume_once
        assert same_weights(server.state_dict(), trainer.weights[2])  # loaded and verified, then not resumed
        # The next cycle has nothing to pull: it used to clear the failure, the engine paused for good.
        with pytest.raises(EngineError, match="could not resume generation"):
            sub.once()
        status = ledger(trainer.store, "h")
        assert status.state == "degraded" and status.failures == 2 and "resume" in status.last_error
        assert paused(server)
        monkeypatch.setattr(eng, "_resume_once", real)
        assert sub.once() is None
        assert not paused(server)
        status = ledger(trainer.store, "h")
        assert status.state == "serving" and status.failures == 0 and status.served_version == 2
        sub.close()


def test_an_engine_gone_while_a_resume_is_pending_is_asked_what_it_serves_once_back(trainer, staged_v1, monkeypatch):
    """A resume that cannot reach the engine at all means it was restarted or moved: nothing of it is paused. The
    watcher no longer fails every cycle on it (review): it asks the restarted engine what it serves."""
    dest, v1_dir = staged_v1
    with WheelSGLang(v1_dir, weight_version="1") as server:
        eng, sub = _left_paused(trainer, dest, server, monkeypatch)
        monkeypatch.setattr(eng, "_resume_once", eng.real_resume_once)
        server.stop()  # it died; a supervisor restarts it below
        assert sub.once() is None  # nothing paused to resume there, and nothing to ask yet: not a failed cycle
        assert not sub._resume_pending
        server.start()  # from version 1's directory, unpaused
        assert sub.once() is not None  # learned it serves version 1 again, and switched it to version 2
        assert not paused(server) and same_weights(server.state_dict(), trainer.weights[2])
        status = ledger(trainer.store, "h")
        assert status.state == "serving" and status.served_version == 2 and status.failures == 0
        sub.close()


def test_the_ledger_entry_stays_fresh_through_a_long_load(trainer, staged_v1):
    """A load longer than five minutes left the leader's entry unrefreshed: `status` called it stale, and the group's
    followers no longer kept the version the engine was loading. The heartbeat goes on during every step."""
    dest, v1_dir = staged_v1
    with WheelSGLang(v1_dir, weight_version="1") as server:
        sub = Subscriber(trainer.store, dest, engine(server), host_id="h", **{**FAST, "heartbeat": 0.2})
        sub.start()
        trainer.push()
        server.inject("slow", seconds=2.0)
        done: list[object] = []
        thread = threading.Thread(target=lambda: done.append(sub.once()))
        thread.start()
        wait_until(lambda: ledger(trainer.store, "h").state == "switching", what="the switch to start")
        stamps = set()
        while len(stamps) < 3 and not done:  # the switch writes its state once; the rest are heartbeats
            status = ledger(trainer.store, "h")
            if status.state == "switching":
                stamps.add(status.updated_at)
            time.sleep(0.05)
        assert len(stamps) >= 3 and not done, stamps
        thread.join(20)
        assert done and ledger(trainer.store, "h").state == "serving"
        sub.close()


def _follower(trainer, tmp_path, dest: str) -> Subscriber:
    return Subscriber(trainer.store, dest, None, host_id="node-1", engine_group="big", engine_hosts=2, **FAST)


def test_a_group_rollback_names_a_path_every_host_has(trainer, staged_v1, tmp_path):
    """Both hosts pulled version 1 before their watchers started (as the unit-file comment says); the leader's engine
    refused version 2, and the rollback sent by-version/v1, which the follower never linked."""
    dest, v1_dir = staged_v1
    follower_dest = str(tmp_path / "node1-dest")
    pull(trainer.store, follower_dest)
    with WheelSGLang(v1_dir, weight_version="1") as server:
        leader = Subscriber(trainer.store, dest, engine(server), host_id="node-0", engine_group="big", engine_hosts=2,
                            **FAST)
        follower = _follower(trainer, tmp_path, follower_dest)
        follower.start()
        leader.start()
        assert os.path.isdir(os.path.join(follower_dest + ".deltafs", "by-version", "v1"))
        trainer.push()
        follower.once()
        server.inject("fail")
        with pytest.raises(SwitchError) as info:
            leader.once()
        assert info.value.rolled_back
        sent = [e.detail["model_path"] for e in server.events if e.what == "update"]
        assert [os.path.basename(p) for p in sent] == ["v2", "v1"]
        assert os.path.isdir(os.path.join(follower_dest + ".deltafs", "by-version", "v1"))
        assert same_weights(server.state_dict(), trainer.weights[1])
        leader.close()
        follower.close()


def test_a_group_is_not_rolled_back_to_a_version_a_host_does_not_hold(trainer, staged_v1, tmp_path, caplog):
    dest, v1_dir = staged_v1
    trainer.push()
    follower_dest = str(tmp_path / "node1-dest")
    with WheelSGLang(v1_dir, weight_version="1") as server:
        leader = Subscriber(trainer.store, dest, engine(server), host_id="node-0", engine_group="big", engine_hosts=2,
                            **FAST)
        follower = _follower(trainer, tmp_path, follower_dest)
        follower.start()
        follower.once()  # a fresh host: it pulls version 2 only
        leader.start()
        server.inject("fail")
        with pytest.raises(SwitchError) as info:
            leader.once()
        assert not info.value.rolled_back
        assert [e.what for e in server.events if e.what == "update"] == ["update"]  # no rollback sent
        assert "not every host of engine group big holds version 1" in caplog.text
        leader.close()
        follower.close()


@contextlib.contextmanager
def _switch_to_v2_recorded(trainer, staged_v1, load_timeout: float) -> Iterator[tuple[str, SGLangEngine, SwitchRecord]]:
    """Version 2 pulled beside version 1, the engine serving 1, and a switch record saying a load of 2 may run."""
    dest, v1_dir = staged_v1
    trainer.push()
    v2_dir = pull(trainer.store, dest).path
    with WheelSGLang(v1_dir, weight_version="1") as server:
        eng = engine(server, load_timeout=load_timeout)
        record = SwitchRecord(dest)
        record.write(eng, Target(v2_dir, "2"))
        yield dest, eng, record


def test_a_watcher_stopped_while_a_killed_switch_loads_leaves_the_engine_and_the_record(trainer, staged_v1, monkeypatch):
    with _switch_to_v2_recorded(trainer, staged_v1, 30) as (dest, eng, record):  # the killed watcher's load
        resumed: list[int] = []
        monkeypatch.setattr(eng, "resume", lambda *a, **k: resumed.append(1))
        sub = Subscriber(trainer.store, dest, eng, host_id="h", **FAST)
        threading.Timer(0.5, sub.stop).start()
        started = time.monotonic()
        sub.start()
        assert time.monotonic() - started < 10
        assert resumed == [] and os.path.exists(record.path)
        sub.close()


def test_a_group_leader_restarted_during_a_killed_switch_keeps_its_followers_holding_what_loads(trainer, staged_v1,
                                                                                                  tmp_path):
    """The leader was killed mid-load of version 2 and restarted; while the new watcher waited for that load, its
    fresh ledger entry (nothing served) replaced the killed one's, and the follower's pulls deleted version 2, which the
    engine's ranks there were reading (adversarial pass). The entry now says what the killed switch left until the wait
    ends, and a watcher stopped during the wait leaves it so."""
    dest, v1_dir = staged_v1
    follower_dest = str(tmp_path / "node1-dest")
    follower = _follower(trainer, tmp_path, follower_dest)
    follower.start()
    follower.once()  # version 1
    trainer.push()
    follower.once()  # version 2
    with WheelSGLang(v1_dir, weight_version="1") as server:
        eng = engine(server, load_timeout=60)
        killed = Subscriber(trainer.store, dest, eng, host_id="node-0", engine_group="big", engine_hosts=2,
                            **{**FAST, "heartbeat": 0.2})
        killed.start()
        killed.poll()  # version 2 staged; the switch to it is sent, then this watcher is killed (kill -9)
        killed.status.staged_version = 2
        killed._set_state("switching")
        SwitchRecord(dest).write(eng, Target(os.path.join(dest + ".deltafs", "by-version", "v2"), "2"))
        again = Subscriber(trainer.store, dest, engine(server, load_timeout=60), host_id="node-0", engine_group="big",
                           engine_hosts=2, **{**FAST, "heartbeat": 0.2})
        thread = threading.Thread(target=again.start)
        thread.start()
        time.sleep(1.0)
        status = ledger(trainer.store, "node-0")
        assert (status.state, status.served_version, status.staged_version) == ("switching", 1, 2)
        in_use = {os.path.basename(p) for p in follower._group_versions_in_use()}
        assert len(in_use) == 2, in_use  # versions 1 and 2 stay on the follower's disk
        again.stop()
        thread.join(10)
        again.close()
        status = ledger(trainer.store, "node-0")
        assert status.state == "switching" and status.staged_version == 2  # not "stopped": the load may still run
        follower.close()


def test_a_wait_for_another_process_switch_ends_when_it_clears_its_record(trainer, staged_v1):
    """A watcher started while a cron `pull --engine` was switching waited out the cron's whole deadline (16 minutes
    by default) after the cron had rolled back, resumed and cleared its record (adversarial pass)."""
    with _switch_to_v2_recorded(trainer, staged_v1, 600) as (_dest, eng, record):
        threading.Timer(1.0, record.clear).start()  # the cron's switch ends (a rollback: the engine stays on 1)
        started = time.monotonic()
        assert record.wait_for_killed(eng)
        assert time.monotonic() - started < 10


def test_an_engine_that_does_not_answer_during_a_killed_switch_is_still_waited_for(trainer, staged_v1, monkeypatch):
    """One /model_info that timed out while a killed switch's load ran ended the wait, and the engine was resumed
    mid-load (docs audit). Only an engine that cannot be reached at all ends it early."""
    from deltafs.errors import EngineError as Busy

    with _switch_to_v2_recorded(trainer, staged_v1, 600) as (_dest, eng, record):
        def busy() -> str:
            raise Busy("GET /model_info timed out after 2s")

        monkeypatch.setattr(eng, "served_version", busy)
        stop = threading.Event()
        threading.Timer(2.5, stop.set).start()
        started = time.monotonic()
        assert record.wait_for_killed(eng, stop) is False  # still waiting when stopped
        assert time.monotonic() - started >= 2.0 and os.path.exists(record.path)


def test_a_degraded_host_keeps_its_entry_fresh_while_it_waits_to_retry(trainer, tmp_path):
    """After failures the daemon waits up to --retry-max (300 s) before the next try, without a ledger write: the
    entry went stale although the host was alive (docs audit)."""
    from watch_helpers import running

    trainer.push()
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "notes.txt").write_text("not a deltafs checkpoint")  # every pull refuses this DEST (exit 9)
    sub = Subscriber(trainer.store, str(dest), None, host_id="h",
                     **{**FAST, "retry_base": 30.0, "retry_max": 30.0, "heartbeat": 0.2})
    with running(sub):
        wait_until(lambda: _state(trainer.store, "h") == "degraded", what="the first failure")
        stamps = set()
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and len(stamps) < 3:
            status = ledger(trainer.store, "h")
            if status.state == "degraded" and status.failures == 1:
                stamps.add(status.updated_at)
            time.sleep(0.05)
        assert len(stamps) >= 3, stamps  # refreshed while it waits (the next try is 15-30 s away)


def _state(store: str, host: str) -> str | None:
    try:
        return ledger(store, host).state
    except FileNotFoundError:
        return None


def _killed_record(dest: str, version: str, seconds: float) -> SwitchRecord:
    """The record a switch killed mid-load (a cron run's, kill -9) leaves: its process is gone."""
    from deltafs.read.dest import atomic_write

    record = SwitchRecord(dest)
    atomic_write(record.path, json.dumps({"version": version, "path": dest, "pid": 2**22 + 7,
                                          "deadline": time.time() + seconds}).encode())
    return record


def test_a_watcher_does_not_switch_while_a_killed_cron_runs_load_may_run(trainer, staged_v1):
    """A cron `pull --engine` was killed mid-load beside a running watcher; the watcher's next switch took the freed
    engine lock and sent its update 6.5 s into that load (adversarial pass). It waits for the record first."""
    dest, v1_dir = staged_v1
    with WheelSGLang(v1_dir, weight_version="1") as server:
        sub = Subscriber(trainer.store, dest, engine(server), host_id="h", **FAST)
        sub.start()
        trainer.push()
        sub.poll()  # version 2 staged
        _killed_record(dest, "2", 2.0)  # the cron's load of version 2 may run for 2 s more
        started = time.monotonic()
        applied = sub.apply()
        assert applied is not None and applied.version == 2
        first = next(e for e in server.events if e.what == "update")
        assert time.monotonic() - started >= 1.5 and first.detail["weight_version"] == "2"
        assert not os.path.exists(SwitchRecord(dest).path) and not paused(server)
        sub.close()


def test_a_wait_goes_on_when_the_record_is_replaced_by_another_switch(trainer, staged_v1):
    """The waiter took a replaced record for "its owner finished" and resumed the engine mid-load of the second
    switch, whose process was killed in turn (adversarial pass)."""
    dest, v1_dir = staged_v1
    with WheelSGLang(v1_dir, weight_version="1") as server:
        eng = engine(server)
        record = _killed_record(dest, "2", 30.0)
        threading.Timer(0.5, lambda: _killed_record(dest, "3", 2.5)).start()  # a second switch, then killed
        started = time.monotonic()
        assert record.wait_for_killed(eng)
        assert time.monotonic() - started >= 2.5 and record.read() is None


def test_an_unreadable_record_is_a_switch_that_may_still_load(trainer, staged_v1):
    """A damaged record was taken for no record, and the engine was resumed mid-load (adversarial pass)."""
    dest, v1_dir = staged_v1
    with WheelSGLang(v1_dir, weight_version="1") as server:
        record = SwitchRecord(dest)
        with open(record.path, "w") as fh:
            fh.write("garbage")
        assert record.pending() is not None
        stop = threading.Event()
        threading.Timer(1.5, stop.set).start()
        assert record.wait_for_killed(engine(server), stop) is False and os.path.exists(record.path)


def test_an_engine_left_paused_by_a_killed_cron_run_is_resumed_by_the_watcher(trainer, staged_v1):
    """A cron run killed mid-switch beside a running watcher left the engine paused for good: the watcher saw
    nothing to do. Its next cycle waits for that switch's load, resumes the engine and asks what it serves."""
    dest, v1_dir = staged_v1
    with WheelSGLang(v1_dir, weight_version="1") as server:
        eng = engine(server)
        sub = Subscriber(trainer.store, dest, eng, host_id="h", **FAST)
        sub.start()
        eng._pause()  # the cron run paused it, sent its update (of the version served), and was killed
        _killed_record(dest, "1", 600.0)
        assert paused(server)
        assert sub.once() is None
        assert not paused(server) and SwitchRecord(dest).read() is None
        assert ledger(trainer.store, "h").state == "serving"
        sub.close()


def test_a_switch_record_that_cannot_be_removed_is_handled_once(trainer, staged_v1, monkeypatch):
    """A read-only sidecar kept a finished switch's record: the watcher took the engine lock and resumed the engine
    at every cycle, and cron runs beside it found the lock held (exit 101) (re-check of the adversarial fixes)."""
    dest, v1_dir = staged_v1
    with WheelSGLang(v1_dir, weight_version="1") as server:
        eng = engine(server)
        sub = Subscriber(trainer.store, dest, eng, host_id="h", **FAST)
        sub.start()
        monkeypatch.setattr(SwitchRecord, "clear", lambda self, only=None: None)  # cannot be removed
        _killed_record(dest, "1", -1.0)  # its time is up
        resumed: list[int] = []
        real = eng.resume
        monkeypatch.setattr(eng, "resume", lambda *a, **k: (resumed.append(1), real(*a, **k)))
        for _ in range(3):
            assert sub.once() is None
        assert resumed == [1]
        sub.close()


@contextlib.contextmanager
def _cycle_waiting_for_killed_cron(trainer, staged_v1, seconds: float) -> Iterator[
        tuple[str, WheelSGLang, Subscriber, threading.Thread]]:
    """A watcher's cycle (sub.once, in a thread) waiting for a cron run's load of version 2 that may run `seconds`
    more (the cron pulled version 2, sent its update and was killed); yielded once its entry says so."""
    dest, v1_dir = staged_v1
    with WheelSGLang(v1_dir, weight_version="1") as server:
        sub = Subscriber(trainer.store, dest, engine(server), host_id="h", **FAST)
        sub.start()
        trainer.push()
        pull(trainer.store, dest)
        _killed_record(dest, "2", seconds)
        thread = threading.Thread(target=sub.once)
        thread.start()
        wait_until(lambda: ledger(trainer.store, "h").state == "switching", what="the wait shown")
        yield dest, server, sub, thread


def test_the_ledger_says_switching_while_a_killed_cron_runs_load_may_run(trainer, staged_v1):
    """While a watcher waited for a killed cron run's load at a cycle (not at start-up), its entry said "serving":
    an engine group's followers would not keep the version being loaded (re-check of the adversarial fixes)."""
    with _cycle_waiting_for_killed_cron(trainer, staged_v1, 2.0) as (dest, server, sub, thread):
        assert ledger(trainer.store, "h").staged_version == 2
        assert SwitchRecord(dest).read() is not None and server.count("update") == 0  # still the cron's load
        thread.join(20)
        assert ledger(trainer.store, "h").state == "serving"
        sub.close()


def test_a_watcher_stopped_while_a_cycle_waits_for_a_killed_cron_run_leaves_its_entry(trainer, staged_v1):
    with _cycle_waiting_for_killed_cron(trainer, staged_v1, 60.0) as (_dest, server, sub, thread):
        sub.stop()
        thread.join(10)
        sub.close()
        status = ledger(trainer.store, "h")
        assert (status.state, status.staged_version) == ("switching", 2) and server.count("update") == 0


def test_once_records_its_failure_in_the_ledger(trainer, staged_v1):
    dest, v1_dir = staged_v1
    with WheelSGLang(v1_dir, weight_version="1") as server:
        trainer.push()
        server.inject("fail")
        result = subprocess.run([sys.executable, "-c", MAIN, "watch", trainer.store, dest, "--engine-url", server.url,
                                 "--once", "--host-id", "cron-1"], capture_output=True, text=True, timeout=120)
        assert result.returncode == 10, result.stderr
        status = ledger(trainer.store, "cron-1")
        assert status.state == "degraded" and status.failures == 1 and "version 2" in status.last_error


def test_sighup_stops_the_watcher_in_order_and_a_stray_sigusr1_is_ignored(trainer, tmp_path):
    trainer.push()
    log = str(tmp_path / "watch.log")
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-c", MAIN, "watch", trainer.store, str(tmp_path / "dest"),
                                 "--host-id", "h", "--poll", "0.2"], stdout=fh, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "version 1 is in" in open(log).read(), timeout=60, what="the first version")
        proc.send_signal(signal.SIGUSR1)
        wait_until(lambda: "SIGUSR1 ignored" in open(log).read(), what="the SIGUSR1 line")
        time.sleep(0.3)
        assert proc.poll() is None
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert ledger(trainer.store, "h").state == "stopped"
