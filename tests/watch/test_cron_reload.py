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
    from deltafs.read.pull import pull

    dest = str(tmp_path / "dest")
    trainer.push()
    pull(trainer.store, dest)
    reload_engine("sglang", engine_server.url, dest=dest)
    trainer.push()
    pull(trainer.store, dest)
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
