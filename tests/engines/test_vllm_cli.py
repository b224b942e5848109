"""`deltafs pull --once --engine vllm` through the installed console command, and engines from entry points.

The engine is vLLM 0.33's own route code around the stand-in engine (vllm_standin.py); a third-party
engine is a package found on the path by its deltafs.engines entry point, as pip would install it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from engine_helpers import same_weights
from sglang_standin import random_weights, tiny_config, write_checkpoint
from vllm_standin import StandinVLLM

from deltafs.engines import engine_kinds, make_engine, reload_engine
from deltafs.publish import push as push_checkpoint
from deltafs.errors import UsageError

CONFIG = tiny_config()
CONSOLE = os.path.join(os.path.dirname(sys.executable), "deltafs")


def deltafs(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    assert os.path.exists(CONSOLE), f"the deltafs console command is not installed beside {sys.executable}"
    return subprocess.run([CONSOLE, *map(str, args)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


@pytest.fixture()
def versions(tmp_path):
    """A store and the weights of the versions pushed so far; push() adds the next one."""
    store, weights = str(tmp_path / "store"), {}

    def push() -> int:
        n = len(weights) + 1
        weights[n] = random_weights(CONFIG, n)
        src = write_checkpoint(str(tmp_path / f"train-{n}"), weights[n], CONFIG)
        assert push_checkpoint(store, src).version == n  # in-process: only pull's command line is under test
        return n

    return store, weights, push


@pytest.fixture()
def engine(tmp_path):
    init = write_checkpoint(str(tmp_path / "initial"), random_weights(CONFIG, 0), CONFIG)
    with StandinVLLM(init, api_key="k3y") as srv:
        yield srv


def test_pull_once_switches_vllm_and_repairs_a_failed_switch(versions, engine, tmp_path):
    store, weights, push = versions
    dest = str(tmp_path / "dest")
    env = {"DELTAFS_ENGINE_API_KEY": "k3y"}
    pull = ("pull", store, dest, "--once", "--engine", "vllm", "--engine-url", engine.url, "--json")
    push()
    first = deltafs(*pull, env=env)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["engine_reloaded"] is True
    assert engine.weight_version == "1" and same_weights(engine.state_dict(), weights[1]) and not engine.paused
    assert deltafs(*pull, env=env).returncode == 100  # current, and the engine serves it: nothing to do
    push()
    engine.inject("midway")  # vLLM reloads in place: half of version 2 lands before the failure
    failed = deltafs(*pull, env=env)
    assert failed.returncode == 10
    last = failed.stderr.strip().splitlines()[-1]  # after the log lines: the one-line error
    assert last.startswith("deltafs: error: switch to version 2 failed: reload_weights from ")
    assert "HTTP 500: injected failure after" in last and last.endswith("; serving version 1 again")
    # The rollback target was version 1's directory, which pull kept beside DEST.
    assert engine.weight_version == "1" and same_weights(engine.state_dict(), weights[1]) and not engine.paused
    repaired = deltafs(*pull, env=env)  # DEST is already current; the engine is not
    assert repaired.returncode == 0, repaired.stderr
    assert engine.weight_version == "2" and same_weights(engine.state_dict(), weights[2])


def test_pull_once_against_a_server_without_dev_mode_says_what_to_do(versions, tmp_path):
    store, weights, push = versions
    push()
    init = write_checkpoint(str(tmp_path / "initial"), random_weights(CONFIG, 0), CONFIG)
    with StandinVLLM(init, dev_mode=False) as srv:
        proc = deltafs("pull", store, str(tmp_path / "dest"), "--once", "--engine", "vllm", "--engine-url", srv.url)
    assert proc.returncode == 10
    assert proc.stderr == (f"deltafs: error: vLLM at {srv.url} has no /resume route: start it with "
                           "VLLM_SERVER_DEV_MODE=1 (deltafs uses the development routes of vLLM 0.33)\n")


def test_watch_once_switches_vllm_to_the_newest_version(versions, engine, tmp_path):
    store, weights, push = versions
    push()
    push()
    dest = str(tmp_path / "dest")
    proc = deltafs("watch", store, dest, "--engine", "vllm", "--engine-url", engine.url, "--once", "--host-id", "h1",
                   "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert engine.weight_version == "2" and same_weights(engine.state_dict(), weights[2]) and not engine.paused
    assert engine.count("reload") == 1  # the watcher went straight to the newest version


def test_watch_verify_rollback_checks_vllms_checksums_after_a_failed_switch(versions, engine, tmp_path):
    store, weights, push = versions
    dest = str(tmp_path / "dest")
    watch = ("watch", store, dest, "--engine", "vllm", "--engine-url", engine.url, "--once", "--host-id", "h1",
             "--verify-rollback")
    push()
    assert deltafs(*watch).returncode == 0  # nothing to roll back to yet: no checksums are taken
    assert engine.weight_version == "1" and engine.count("checksums") == 0
    push()
    engine.inject("midway")  # half of version 2 lands, then the reload fails
    failed = deltafs(*watch)
    assert failed.returncode == 10
    assert failed.stderr.strip().splitlines()[-1].endswith("; serving version 1 again")
    assert engine.count("checksums") == 2  # before the load, and the compare after the rollback
    assert engine.weight_version == "1" and same_weights(engine.state_dict(), weights[1]) and not engine.paused


def test_verify_rollback_is_refused_for_other_engines(versions, tmp_path):
    store, _, push = versions
    push()
    proc = deltafs("watch", store, str(tmp_path / "dest"), "--engine", "sglang", "--engine-url", "http://127.0.0.1:9",
                   "--once", "--verify-rollback")
    assert proc.returncode == 2
    assert proc.stderr == "deltafs: error: --verify-rollback works with --engine vllm only, not sglang\n"
    assert not os.path.exists(tmp_path / "dest")


# --- third-party engines --------------------------------------------------------------------------
FILE_ENGINE = '''
"""A third-party engine: "serves" a checkpoint by recording it in a JSON file (url = the file)."""
import json, os, time
from deltafs.engines.base import SwitchResult


class FileEngine:
    kind = "fileengine"

    def __init__(self, url, **options):
        self.path = url

    def served_version(self):
        if not os.path.exists(self.path):
            return None
        with open(self.path) as fh:
            return json.load(fh)["version"]

    def busy_requests(self):
        return 0

    def resume(self):
        pass

    def switch(self, target, previous):
        t = time.monotonic()
        with open(self.path, "w") as fh:
            json.dump({"version": target.version, "path": target.path}, fh)
        return SwitchResult(version=target.version, pause_seconds=time.monotonic() - t, load_seconds=0.0)


def not_an_engine(url, **options):
    return object()
'''


@pytest.fixture()
def plugin_path(tmp_path, monkeypatch) -> str:
    """A directory holding an installed-looking package with three deltafs.engines entry points."""
    root = tmp_path / "site"
    dist = root / "deltafs_fileengine-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: deltafs-fileengine\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent("""\
        [deltafs.engines]
        fileengine = deltafs_fileengine:FileEngine
        notanengine = deltafs_fileengine:not_an_engine
        missing = deltafs_no_such_module:Engine
        sglang = deltafs_fileengine:FileEngine
        """))
    (root / "deltafs_fileengine.py").write_text(FILE_ENGINE)
    monkeypatch.syspath_prepend(str(root))
    return str(root)


def test_pull_once_switches_an_engine_registered_by_another_package(versions, plugin_path, tmp_path):
    store, _, push = versions
    push()
    served = str(tmp_path / "served.json")
    dest = str(tmp_path / "dest")
    proc = deltafs("pull", store, dest, "--once", "--engine", "fileengine", "--engine-url", served,
                   env={"PYTHONPATH": plugin_path})
    assert proc.returncode == 0, proc.stderr
    with open(served) as fh:
        record = json.load(fh)
    assert record["version"] == "1" and os.path.realpath(record["path"]) == os.path.realpath(dest)


def test_entry_point_errors_are_one_line_usage_errors(plugin_path):
    assert engine_kinds() == ["sglang", "vllm", "fileengine", "missing", "notanengine", "none"]
    with pytest.raises(UsageError, match=r"unknown engine 'nope'; use one of sglang, vllm, fileengine, missing, notanengine, none"):
        make_engine("nope", "x")
    with pytest.raises(UsageError, match=r"engine 'missing' \(deltafs_no_such_module:Engine\) cannot be loaded: No module named"):
        make_engine("missing", "x")
    with pytest.raises(UsageError, match=r"engine 'notanengine' \(deltafs_fileengine:not_an_engine\) did not return an Engine"):
        make_engine("notanengine", "x")


def test_built_in_names_cannot_be_taken_over(plugin_path):
    assert type(make_engine("sglang", "http://127.0.0.1:1")).__name__ == "SGLangEngine"


def test_reload_engine_drives_a_registered_engine(plugin_path, tmp_path):
    served = str(tmp_path / "served.json")
    ckpt = write_checkpoint(str(tmp_path / "v7"), random_weights(CONFIG, 7), CONFIG)
    assert reload_engine("fileengine", served, ckpt, 7).version == "7"
    assert reload_engine("fileengine", served, ckpt, 7) is None  # it reports 7 now
