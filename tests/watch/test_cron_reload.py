"""Cron mode: `deltafs pull --once --engine sglang` pulls, then switches the engine through reload_engine."""

from __future__ import annotations

import subprocess
import sys

import pytest
from watch_helpers import same_weights

from deltafs.engines import SwitchError, reload_engine
from deltafs.read.pull import local_version

MAIN = "import sys; from deltafs.cli.main import main; sys.argv[0] = 'deltafs'; main()"


def pull_once(store: str, dest: str, url: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", MAIN, "pull", store, dest, "--once", "--engine", "sglang",
                           "--engine-url", url], capture_output=True, text=True, timeout=60)


def _engine_on_1_dest_on_2(trainer, tmp_path, engine_server) -> str:
    """Versions 1 and 2 pulled into DEST (returned), the engine switched to 1."""
    from deltafs.read.pull import pull

    dest = str(tmp_path / "dest")
    trainer.push()
    pull(trainer.store, dest)
    reload_engine("sglang", engine_server.url, dest=dest)
    trainer.push()
    pull(trainer.store, dest)
    return dest


def test_pull_once_reloads_the_engine(trainer, tmp_path, engine_server):
    dest = str(tmp_path / "dest")
    trainer.push()
    first = pull_once(trainer.store, dest, engine_server.url)
    assert first.returncode == 0, first.stderr
    assert engine_server.weight_version == "1" and not engine_server.paused
    again = pull_once(trainer.store, dest, engine_server.url)
    assert again.returncode == 100
    trainer.push()
    second = pull_once(trainer.store, dest, engine_server.url)
    assert second.returncode == 0, second.stderr
    assert same_weights(engine_server.state_dict(), trainer.weights[2])


def test_failed_reload_rolls_back_to_the_version_the_engine_served(trainer, tmp_path, engine_server):

    dest = _engine_on_1_dest_on_2(trainer, tmp_path, engine_server)
    engine_server.inject("success_false")
    with pytest.raises(SwitchError, match="serving version 1 again"):
        reload_engine("sglang", engine_server.url, dest=dest)
    # The rollback target was found beside DEST: version 1's directory, which pull kept.
    assert engine_server.weight_version == "1" and not engine_server.paused
    assert same_weights(engine_server.state_dict(), trainer.weights[1])
    # The next run (DEST already current) repairs the engine.
    assert reload_engine("sglang", engine_server.url, dest=dest) is not None
    assert engine_server.weight_version == "2" and local_version(dest).version == 2


def test_pull_once_repairs_an_engine_left_on_the_old_version(trainer, tmp_path, engine_server):
    dest = str(tmp_path / "dest")
    trainer.push()
    assert pull_once(trainer.store, dest, engine_server.url).returncode == 0
    trainer.push()
    engine_server.inject("success_false")
    failed = pull_once(trainer.store, dest, engine_server.url)
    assert failed.returncode == 10, failed.stderr
    assert engine_server.weight_version == "1" and not engine_server.paused
    engine_server.clear_faults()
    repaired = pull_once(trainer.store, dest, engine_server.url)  # DEST is already current; the engine is not
    assert repaired.returncode == 0, repaired.stderr
    assert engine_server.weight_version == "2"
    assert pull_once(trainer.store, dest, engine_server.url).returncode == 100


def test_a_cron_run_after_a_killed_watchers_switch_waits_for_that_load(trainer, tmp_path, engine_server):
    """A watcher killed mid-load left DEST.deltafs/engine-switch.json; a cron `pull --engine` took the freed
    engine.lock, resumed the engine mid-load and sent a second update, which crashes SGLang (adversarial pass).
    reload_engine now waits for the recorded load like a restarted watcher: no resume, no update until the engine
    reports that version."""
    import json
    import os
    import threading
    import time

    from deltafs.read.pull import pull

    dest = str(tmp_path / "dest")
    trainer.push()
    pull(trainer.store, dest)
    reload_engine("sglang", engine_server.url, dest=dest)
    trainer.push()
    staged = pull(trainer.store, dest)
    record = os.path.join(dest + ".deltafs", "engine-switch.json")
    with open(record, "w") as fh:
        json.dump({"version": "2", "path": staged.path, "pid": 1, "deadline": time.time() + 20}, fh)
    engine_server.paused = True  # the killed watcher's pause; its load of version 2 still runs
    updates, continues = engine_server.count("update"), engine_server.count("continue")

    def load_finishes() -> None:  # as the killed watcher's load sets them
        engine_server.model_path, engine_server.weight_version = staged.path, "2"

    threading.Timer(1.5, load_finishes).start()
    t0 = time.monotonic()
    assert reload_engine("sglang", engine_server.url, dest=dest) is None  # the killed watcher's load did it
    assert time.monotonic() - t0 >= 1.0
    assert engine_server.count("update") == updates and engine_server.count("continue") == continues + 1
    assert not engine_server.paused and not os.path.exists(record)


def test_sigterm_during_a_cron_switch_lets_it_finish(trainer, tmp_path, engine_server):
    """`timeout` or systemd stopping `pull --once --engine` mid-load killed it with the engine paused (exit 143,
    no continue_generation). The switch now finishes and resumes the engine; the run ends as usual."""
    import os
    import signal
    import time

    dest = str(tmp_path / "dest")
    trainer.push()
    assert pull_once(trainer.store, dest, engine_server.url).returncode == 0
    trainer.push()
    engine_server.inject("slow", seconds=2.0)
    proc = subprocess.Popen([sys.executable, "-c", MAIN, "pull", trainer.store, dest, "--once", "--engine", "sglang",
                             "--engine-url", engine_server.url], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while engine_server.count("update") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "finishing the switch first" in err
    assert engine_server.weight_version == "2" and not engine_server.paused
    assert same_weights(engine_server.state_dict(), trainer.weights[2])
    assert not os.path.exists(dest + ".deltafs/engine-switch.json")


def test_a_signal_outside_a_switch_interrupts_and_a_second_one_inside_it_too():
    """One signal per switch is let pass; a second interrupts; the next switch lets one pass again."""
    from deltafs.engines import inflight
    from deltafs.watch import signals

    with pytest.raises(KeyboardInterrupt):
        signals.finish_switch_first(15, None)
    for _ in range(2):
        with inflight.switching():
            signals.finish_switch_first(15, None)  # let pass once
            with pytest.raises(KeyboardInterrupt):
                signals.finish_switch_first(15, None)
    with pytest.raises(KeyboardInterrupt):
        signals.finish_switch_first(2, None)


def test_an_interrupted_switch_leaves_its_record_for_the_next_process(tmp_path):
    """A second signal interrupts a switch whose load may still run: the record stays, so the next watcher or cron
    run waits for that load; a switch that ends (or fails with an error) removes it."""
    import os

    from deltafs.engines.base import Target
    from deltafs.engines.inflight import SwitchRecord

    dest = str(tmp_path / "dest")
    os.makedirs(dest + ".deltafs")

    class Remote:
        url = "http://127.0.0.1:1"
        load_timeout = 5.0

    record = SwitchRecord(dest)
    with pytest.raises(KeyboardInterrupt), record.around(Remote(), Target(dest, "2")):
        raise KeyboardInterrupt
    assert os.path.exists(record.path)
    with pytest.raises(RuntimeError), record.around(Remote(), Target(dest, "2")):
        raise RuntimeError("the switch failed")
    assert not os.path.exists(record.path)


def test_a_cron_run_while_another_process_switches_the_engine_is_busy_not_an_error(trainer, tmp_path, engine_server):
    """The pull is done; the engine lock is held by a watcher mid-switch: exit 8 "error" fired cron alerts for a
    harmless overlap (adversarial pass). It is the quiet "busy" of --once (101) now; the next run reloads."""
    import json

    from deltafs.read.dest import LocalCheckpoint
    from deltafs.read.pull import pull

    dest = str(tmp_path / "dest")
    trainer.push()
    pull(trainer.store, dest)
    reload_engine("sglang", engine_server.url, dest=dest)
    trainer.push()
    with LocalCheckpoint(dest).lock(name="engine.lock"):  # the watcher's switch
        busy = subprocess.run([sys.executable, "-c", MAIN, "pull", trainer.store, dest, "--once", "--json", "--engine",
                               "sglang", "--engine-url", engine_server.url], capture_output=True, text=True, timeout=60)
    assert busy.returncode == 101, (busy.stdout, busy.stderr)
    result = json.loads(busy.stdout)
    assert result["status"] == "busy" and result["engine_reloaded"] is False and result["version"] == 2
    assert engine_server.weight_version == "1" and local_version(dest).version == 2
    again = pull_once(trainer.store, dest, engine_server.url)
    assert again.returncode == 0, again.stderr
    assert engine_server.weight_version == "2"


def test_a_previous_version_removed_while_compared_is_no_restart_reason(trainer, tmp_path, engine_server, monkeypatch):
    """A watcher's cleanup removed the version the engine served while a cron run compared it with the new one: its
    files read as missing, and the run said "needs an engine restart: config config.json removed", exit 10
    (adversarial pass). A previous version gone during the comparison counts as gone before it: no comparison."""
    import shutil

    from deltafs.engines import switch

    dest = _engine_on_1_dest_on_2(trainer, tmp_path, engine_server)
    real = switch.restart_reason

    def removed_meanwhile(served: str, new: str):
        shutil.rmtree(served)  # the other process's cleanup, mid-comparison
        return real(served, new)

    monkeypatch.setattr(switch, "restart_reason", removed_meanwhile)
    assert reload_engine("sglang", engine_server.url, dest=dest) is not None
    assert engine_server.weight_version == "2" and same_weights(engine_server.state_dict(), trainer.weights[2])


def test_cleanup_survives_entries_that_vanish_while_it_lists(tmp_path, monkeypatch):
    """A cron run's cleanup listed DEST.deltafs while a watcher's switch record came and went: lstat raised
    FileNotFoundError and the run exited 1 after a successful pull (adversarial pass)."""
    import os

    from deltafs.read.dest import LocalCheckpoint

    local = LocalCheckpoint(str(tmp_path / "dest"))
    local.ensure_sidecar()
    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda p: [*real(p), "engine-switch.json", ".tmp-" + "0" * 32,
                                                  "v0000000009-0000aaaa"])
    assert local.cleanup(keep=2) == [] and local.remove_stale_staging() == []
    from deltafs.read.dest import find_version_dir

    assert local.version_dirs() == [] and find_version_dir(local.dest, "9") is None


def test_cleanup_renames_a_version_away_before_deleting_it(trainer, tmp_path, monkeypatch):
    """A cron run's restart check compared the served version while a cleanup's rmtree deleted it file by file:
    config.json already gone, the directory still there, "needs an engine restart" (review). Cleanup renames a
    doomed version first in both modes, so it is gone at once and the check says nothing."""
    import os

    from deltafs.read import dest as dest_module
    from deltafs.read.dest import LocalCheckpoint
    from deltafs.read.pull import pull

    dest = str(tmp_path / "dest")
    for _ in range(3):
        trainer.push()
        pull(trainer.store, dest, keep=3)
    removed: list[str] = []
    monkeypatch.setattr(dest_module, "_remove_trees", lambda paths: removed.extend(paths))
    assert LocalCheckpoint(dest).cleanup(keep=1) != []
    assert removed and all(os.path.basename(p).startswith("staging-") for p in removed), removed



def _new_run_at_the_same_url(trainer, tmp_path):
    """The store deleted and pushed again by a new run (a new store id; other weights), at version 1."""
    import shutil

    from watch_helpers import Trainer

    shutil.rmtree(trainer.store)
    rerun = Trainer(trainer.store, str(tmp_path / "rerun-cache"))
    rerun._current = {k: v + 1 for k, v in rerun._current.items()}
    rerun.push()
    return rerun


@pytest.mark.parametrize("keep", [2, 1])
def test_a_new_runs_version_with_the_number_the_engine_reports_is_loaded(trainer, tmp_path, engine_server, keep):
    """The engine served version 1 of the old run; DEST was replaced (--force) by version 1 of a new run at the same
    store URL. The engine's "1" is the old run's: reload_engine said "already serving" and the engine kept the old
    run's weights for good (every later cron run agreed). A number DEST holds from two stores proves nothing, nor
    one whose old run's directory is gone (keep=1) while the engine's model_path still names it."""
    from deltafs.read.pull import pull

    dest = str(tmp_path / "dest")
    trainer.push()
    pull(trainer.store, dest)
    reload_engine("sglang", engine_server.url, dest=dest)
    rerun = _new_run_at_the_same_url(trainer, tmp_path)
    pull(trainer.store, dest, force=True, keep=keep)
    assert reload_engine("sglang", engine_server.url, dest=dest) is not None
    assert same_weights(engine_server.state_dict(), rerun.weights[1])
    # Now the engine's model_path names the new run's directory: no reload at every run from here on.
    assert reload_engine("sglang", engine_server.url, dest=dest) is None


def test_a_failed_switch_to_a_new_run_rolls_back_to_the_old_runs_weights(trainer, tmp_path, engine_server):
    """Same set-up, the switch fails: the rollback target is what the engine serves (the old run's version 1, found
    from its model_path), never the new run's directory of the same number."""
    from deltafs.read.pull import pull

    dest = str(tmp_path / "dest")
    trainer.push()
    pull(trainer.store, dest)
    reload_engine("sglang", engine_server.url, dest=dest)
    _new_run_at_the_same_url(trainer, tmp_path)
    pull(trainer.store, dest, force=True)
    engine_server.inject("success_false")
    with pytest.raises(SwitchError, match="serving version 1 again"):
        reload_engine("sglang", engine_server.url, dest=dest)
    assert same_weights(engine_server.state_dict(), trainer.weights[1])


def test_a_version_needing_a_restart_after_a_failed_reload_is_refused_not_hot_switched(trainer, tmp_path,
                                                                                         engine_server):
    """The reload of version 2 failed (the engine stays on 1), then version 3 changed config.json: the next run's
    cleanup removed version 1's directory, the engine's, so the restart check had nothing to compare with and the
    version was hot-switched, "now serves version 3", exit 0 (adversarial pass; a real SGLang then serves the new
    tensors under the old config). The pull keeps the directory the engine serves."""
    import json

    from watch_helpers import CONFIG

    dest = str(tmp_path / "dest")
    trainer.push()
    assert pull_once(trainer.store, dest, engine_server.url).returncode == 0
    trainer.push()
    engine_server.inject("success_false")
    assert pull_once(trainer.store, dest, engine_server.url).returncode == 10
    engine_server.clear_faults()
    assert engine_server.weight_version == "1"
    trainer.push(extra_files={"config.json": json.dumps({**CONFIG, "rope_theta": 1234.0}).encode()})
    third = pull_once(trainer.store, dest, engine_server.url)
    assert third.returncode == 10 and "restart" in third.stderr, third.stderr
    assert engine_server.weight_version == "1" and same_weights(engine_server.state_dict(), trainer.weights[1])


def test_an_engine_restarted_from_other_weights_under_the_same_label_is_reloaded_by_cron(trainer, tmp_path,
                                                                                          engine_server):
    """`--model-path /elsewhere --weight-version 1`: cron said "current" (exit 100) and left the other weights."""
    import requests

    dest = str(tmp_path / "dest")
    trainer.push()
    assert pull_once(trainer.store, dest, engine_server.url).returncode == 0
    elsewhere = str(tmp_path / "initial")  # the engine fixture's unrelated checkpoint
    reply = requests.post(f"{engine_server.url}/update_weights_from_disk",
                          json={"model_path": elsewhere, "weight_version": "1"}, timeout=30)
    assert reply.status_code == 200 and engine_server.weight_version == "1"
    again = pull_once(trainer.store, dest, engine_server.url)
    assert again.returncode == 0, again.stderr
    assert same_weights(engine_server.state_dict(), trainer.weights[1])
    assert pull_once(trainer.store, dest, engine_server.url).returncode == 100  # and only once


def test_a_served_checkpoint_whose_layout_cannot_be_read_needs_a_restart(tmp_path):
    """restart_reason read a served directory deltafs never checked (the engine's first checkpoint): a safetensors
    header nested too deeply was a RecursionError out of the cron run or the watcher. Now it is a reason to restart."""
    import struct

    from deltafs.engines.compat import restart_reason

    (tmp_path / "new").mkdir()
    header = b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    (tmp_path / "new" / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    for name, served in (("deep", b"[" * 100_000 + b"]" * 100_000), ("list", b"[]")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(struct.pack("<Q", len(served)) + served)
        reason = restart_reason(str(tmp_path / name), str(tmp_path / "new"))
        assert reason is not None and reason.startswith("the tensor layout of the served checkpoint cannot be read")
