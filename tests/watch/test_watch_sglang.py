"""The watcher against SGLang 0.5.23's own update code (tests/sglang_wheel_server.py) while a trainer pushes.

What a user relies on: a slow load ends on the new version without a second update; a version that
changes config, tokenizer or tensor set is staged but not hot-switched (needs-restart in the ledger
and `deltafs status`), and the engine keeps serving; the engine's version is learned from model_path
when it reports "default"; loaded-weight checksums land in the ledger; a multi-node engine switches
only once every host has staged the version; `deltafs launch-args` prints how to start a replica.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import typer
from deltafs.cli.watch import register
from sglang_wheel_server import WheelSGLang
from typer.testing import CliRunner
from watch_helpers import CONFIG, FAST, running, same_weights, wait_until

from deltafs.engines import NeedsRestartError, reload_engine
from deltafs.engines.sglang import SGLangEngine
from deltafs.read.dest import LocalCheckpoint
from deltafs.store.open import open_objects
from deltafs.store.repo import Repository
from deltafs.watch import Subscriber
from deltafs.watch.group import GroupNotReadyError
from deltafs.watch.ledger import HostStatus, fleet_report, ledger_key

MAIN = "import sys; from deltafs.cli.main import main; sys.argv[0] = 'deltafs'; main()"


def engine(server: WheelSGLang, **kw) -> SGLangEngine:
    return SGLangEngine(server.url, timeout=2, load_timeout=kw.pop("load_timeout", 10), poll_interval=0.1, **kw)


def ledger(store: str, host: str = "rollout-0") -> HostStatus:
    return HostStatus.from_bytes(open_objects(store).get(ledger_key(host)))


def ledger_says(store: str, host: str = "rollout-0", **expected: object) -> bool:
    try:
        status = ledger(store, host)
    except FileNotFoundError:
        return False
    return all(getattr(status, k) == v for k, v in expected.items())


def cli(*args: str):
    app = typer.Typer()
    register(app)
    return CliRunner().invoke(app, list(args), standalone_mode=False)


@pytest.fixture()
def staged_v1(trainer, tmp_path):
    """Version 1 pushed and pulled into DEST; returns (dest, version-1 directory)."""
    from deltafs.read.pull import pull

    trainer.push()
    dest = str(tmp_path / "dest")
    res = pull(trainer.store, dest)
    return dest, res.path


def test_slow_load_past_the_deadline_ends_on_the_new_version_without_a_second_update(trainer, staged_v1):
    dest, v1_dir = staged_v1
    with WheelSGLang(v1_dir, weight_version="1") as server:
        sub = Subscriber(trainer.store, dest, engine(server, load_timeout=0.5), host_id="rollout-0", **FAST)
        with running(sub):
            server.inject("slow", seconds=2.0)
            trainer.push()
            wait_until(lambda: ledger_says(trainer.store, served_version=2, failures=0, state="serving"),
                       timeout=30, what="version 2 served after the slow load")
        assert server.count("update") == 1 and not server.deaths  # learned from /model_info, never re-sent
        assert same_weights(server.state_dict(), trainer.weights[2]) and not server.paused


def test_version_with_another_config_needs_a_restart_and_keeps_serving(trainer, staged_v1, tmp_path):
    dest, v1_dir = staged_v1
    with WheelSGLang(v1_dir, weight_version="1") as server:
        sub = Subscriber(trainer.store, dest, engine(server), host_id="rollout-0", **FAST)
        sub.start()
        changed = dict(CONFIG, rope_theta=20000.0)
        trainer.push(extra_files={"config.json": json.dumps(changed).encode()})
        with pytest.raises(NeedsRestartError, match="config config.json changed"):
            sub.sync()
        assert server.count("update") == 0 and not server.paused
        assert same_weights(server.state_dict(), trainer.weights[1])
        status = ledger(trainer.store)
        assert status.state == "needs-restart" and status.needs_restart["version"] == 2
        assert LocalCheckpoint(dest).state().version == 2  # staged for the restart
        shown = cli("status", trainer.store)
        assert shown.return_value == 1 and "version 2 needs an engine restart (config config.json changed)" in shown.output
        assert f"deltafs launch-args {os.path.abspath(dest)}" in shown.output

        args = cli("launch-args", dest)
        assert args.output.split() == ["--model-path", os.path.abspath(dest), "--weight-version", "2"]
        # The operator restarts SGLang with those arguments; the watcher sees it and is healthy again.
        server.launch_path, server.launch_version = os.path.abspath(dest), "2"
        server.restart()
        assert sub.sync() is None
        assert ledger(trainer.store).state == "serving" and ledger(trainer.store).needs_restart is None
        sub.close()


@pytest.mark.parametrize("change", ["tokenizer", "tensor"])
def test_tokenizer_or_tensor_set_change_needs_a_restart_in_cron_mode_too(trainer, staged_v1, change):
    import torch

    dest, v1_dir = staged_v1
    with WheelSGLang(v1_dir, weight_version="1") as server:
        if change == "tokenizer":
            trainer.push(extra_files={"config.json": json.dumps(CONFIG).encode(), "tokenizer.json": b'{"v": 2}'})
            expected = "tokenizer file tokenizer.json added"
        else:
            trainer._current["extra.weight"] = torch.zeros(4, dtype=torch.bfloat16)
            trainer.push()
            expected = "tensor names differ: 1 added (extra.weight)"
        from deltafs.read.pull import pull

        pull(trainer.store, dest)
        with pytest.raises(NeedsRestartError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            reload_engine("sglang", server.url, dest=dest)
        assert server.count("update") == 0 and server.reported_versions() == ["1"]


def test_default_weight_version_is_learned_from_model_path(trainer, staged_v1):
    dest, v1_dir = staged_v1
    with WheelSGLang(v1_dir) as server:  # started without --weight-version: reports "default"
        sub = Subscriber(trainer.store, dest, engine(server), host_id="rollout-0", **FAST)
        sub.start()
        assert sub.served is not None and sub.served.version == "1"
        assert ledger(trainer.store).served_version == 1
        assert sub.sync() is None and server.count("update") == 0  # already current: nothing reloaded
        trainer.push()
        assert sub.sync().version == 2
        assert server.reported_versions() == ["2"]
        sub.close()


def test_started_from_dest_without_a_version_is_reloaded_once(trainer, staged_v1):
    dest, _ = staged_v1
    with WheelSGLang(dest) as server:  # --model-path DEST, no --weight-version
        sub = Subscriber(trainer.store, dest, engine(server), host_id="rollout-0", **FAST)
        sub.start()
        applied = sub.sync()
        assert applied is not None and applied.version == 1 and server.reported_versions() == ["1"]
        assert sub.sync() is None and server.count("update") == 1
        sub.close()


def test_loaded_weight_checksums_are_recorded_and_disagreement_is_reported(trainer, staged_v1, tmp_path):
    from deltafs.read.pull import pull

    dest, v1_dir = staged_v1
    other_dest = str(tmp_path / "dest-b")
    b_dir = pull(trainer.store, other_dest).path
    # Replica b loaded version 1 from its own verified directory, and its weights in memory then went wrong (a bad
    # load, a stray write): what only the engine's own checksum can show. (An engine started from other weights
    # under the same label is reloaded instead: its model_path is not the label's directory.)
    with WheelSGLang(v1_dir, weight_version="1") as a, WheelSGLang(b_dir, weight_version="1") as b:
        name = next(iter(b.scheduler.model.tensors))
        b.scheduler.model.tensors[name] = b.scheduler.model.tensors[name] + 1
        sub_a = Subscriber(trainer.store, dest, engine(a), host_id="rollout-a", **FAST)
        sub_b = Subscriber(trainer.store, other_dest, engine(b), host_id="rollout-b", **FAST)
        sub_a.start()
        sub_b.start()
        sums = ledger(trainer.store, "rollout-a").checksums
        assert list(sums) == ["1"] and sums["1"] != ledger(trainer.store, "rollout-b").checksums["1"]
        report = fleet_report(Repository.open(trainer.store))
        problems = {r.status.host_id: r.problem for r in report.hosts}
        assert "loaded weights of version 1 differ from rollout-b" in problems["rollout-a"]
        assert not report.healthy
        # After both load version 2 from their verified directories, they agree again.
        trainer.push()
        sub_a.sync()
        sub_b.sync()
        assert ledger(trainer.store, "rollout-a").checksums["2"] == ledger(trainer.store, "rollout-b").checksums["2"]
        assert fleet_report(Repository.open(trainer.store)).healthy
        sub_a.close()
        sub_b.close()


def _leader(trainer, dest: str, server: WheelSGLang, **kw) -> Subscriber:
    """The watcher of a two-host engine group ("big") on the host serving SGLang's HTTP API."""
    return Subscriber(trainer.store, dest, engine(server), host_id="node-0", engine_group="big", engine_hosts=2, **kw)


def _group_loaded(server: WheelSGLang, dest: str, trainer, version: int) -> None:
    """The group's one switch sent the path that is the same on every host, and the engine holds that version."""
    sent = [e.detail["model_path"] for e in server.events if e.what == "update"]
    assert sent == [os.path.join(os.path.abspath(dest) + ".deltafs", "by-version", f"v{version}")]
    assert same_weights(server.state_dict(), trainer.weights[version])


def test_multi_node_engine_switches_once_every_host_has_staged(trainer, staged_v1, tmp_path):
    dest, v1_dir = staged_v1
    with WheelSGLang(v1_dir, weight_version="1") as server:
        leader = _leader(trainer, dest, server, **FAST)
        follower = Subscriber(trainer.store, str(tmp_path / "node1-dest"), None, host_id="node-1", engine_group="big",
                              engine_hosts=2, **FAST)
        leader.start()
        follower.start()
        trainer.push()
        with pytest.raises(GroupNotReadyError, match="1/2 hosts have version 2 staged") as info:
            leader.sync()
        assert not info.value.timed_out and server.count("update") == 0
        assert ledger(trainer.store, "node-0").state == "waiting-group"
        shown = cli("status", trainer.store)
        assert "waiting-group" in shown.output and "1/2 hosts have version 2 staged" in shown.output
        follower.sync()  # node 1 stages version 2 and records it
        applied = leader.sync()
        assert applied is not None and applied.version == 2
        _group_loaded(server, dest, trainer, 2)
        leader.close()
        follower.close()


def test_multi_node_switch_waits_for_hosts_that_hold_that_very_version(trainer, staged_v1, tmp_path):
    """A host that came back after the leader staged version 2 pulled version 3 directly; the group counted it
    ready for 2 (it had "2 or newer") and the engine was sent by-version/v2, which that host never had
    (adversarial pass). Each host now lists the versions it can load (`held`), and the group switches to one they
    all hold."""
    dest, v1_dir = staged_v1
    with WheelSGLang(v1_dir, weight_version="1") as server:
        leader = _leader(trainer, dest, server, **FAST)
        follower_dest = str(tmp_path / "node1-dest")
        follower = Subscriber(trainer.store, follower_dest, None, host_id="node-1", engine_group="big",
                              engine_hosts=2, **FAST)
        leader.start()
        trainer.push()
        with pytest.raises(GroupNotReadyError):
            leader.sync()  # version 2 staged; node 1 is down
        trainer.push()
        follower.start()
        follower.sync()  # node 1 comes back and pulls the newest, version 3
        assert ledger(trainer.store, "node-1").held == [3]
        assert not os.path.exists(os.path.join(follower_dest + ".deltafs", "by-version", "v2"))
        with pytest.raises(GroupNotReadyError, match="1/2 hosts have version 2"):
            leader.apply()  # the boundary came for version 2: node 1 cannot load it
        assert server.count("update") == 0
        applied = leader.sync()  # the leader stages version 3, which both hold
        assert applied is not None and applied.version == 3
        _group_loaded(server, dest, trainer, 3)
        leader.close()
        follower.close()


def test_multi_node_host_that_never_stages_blocks_with_a_clear_status(trainer, staged_v1):
    dest, v1_dir = staged_v1
    with WheelSGLang(v1_dir, weight_version="1") as server:
        leader = _leader(trainer, dest, server, group_timeout=0.0, **FAST)
        leader.start()
        trainer.push()
        with running(leader):
            wait_until(lambda: ledger_says(trainer.store, "node-0", state="degraded"), what="the group timeout reported")
        status = ledger(trainer.store, "node-0")
        assert "1 host(s) with no live ledger entry" in status.last_error and "check their watchers" in status.last_error
        assert server.count("update") == 0 and status.served_version == 1


def test_watch_cli_with_both_keys_from_the_environment(trainer, staged_v1):
    dest, v1_dir = staged_v1
    with WheelSGLang(v1_dir, weight_version="1", api_key="user-key", admin_api_key="admin-key") as server:
        trainer.push()
        env = {**os.environ, "DELTAFS_ENGINE_API_KEY": "user-key", "DELTAFS_ENGINE_ADMIN_API_KEY": "admin-key"}
        done = subprocess.run([sys.executable, "-c", MAIN, "watch", trainer.store, dest, "--engine-url", server.url,
                               "--once", "--no-ledger"], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert server.reported_versions() == ["2"]
        env.pop("DELTAFS_ENGINE_ADMIN_API_KEY")
        trainer.push()
        refused = subprocess.run([sys.executable, "-c", MAIN, "watch", trainer.store, dest, "--engine-url", server.url,
                                  "--once", "--no-ledger"], env=env, capture_output=True, text=True, timeout=120)
        assert refused.returncode != 0 and "DELTAFS_ENGINE_ADMIN_API_KEY" in refused.stderr
        assert server.reported_versions() == ["2"] and not server.paused


def test_cron_reload_never_joins_a_switch_still_running_on_the_same_dest(trainer, staged_v1):
    from deltafs.errors import LockHeldError
    from deltafs.read.pull import pull

    dest, v1_dir = staged_v1
    with WheelSGLang(v1_dir, weight_version="1") as server:
        trainer.push()
        pull(trainer.store, dest)
        with LocalCheckpoint(dest).lock(name="engine.lock"):  # an earlier run, still waiting for SGLang
            with pytest.raises(LockHeldError, match="another deltafs process"):
                reload_engine("sglang", server.url, dest=dest)
        assert server.count("update") == 0
        assert reload_engine("sglang", server.url, dest=dest).version == "2"


class _Hook:
    """A task boundary at which something else happens first (the orchestrator's signal arrives after it)."""

    name = "signal"

    def __init__(self, fn) -> None:
        self.fn = fn

    def wait(self, engine, stop) -> bool:
        self.fn()
        return not stop.is_set()

    def close(self) -> None:
        pass


def _relabel(server: WheelSGLang, model_path: str, label: str) -> None:
    """Load model_path under weight_version `label` behind the watcher's back (SGLang's own update code)."""
    import requests

    reply = requests.post(f"{server.url}/update_weights_from_disk",
                          json={"model_path": model_path, "weight_version": label}, timeout=30)
    assert reply.status_code == 200 and server.reported_versions()[-1] == label


def _sent(server: WheelSGLang) -> list[str]:
    return [os.path.basename(os.path.realpath(e.detail["model_path"])) for e in server.events if e.what == "update"]


def test_a_boundary_switches_to_what_was_pushed_while_it_waited(trainer, staged_v1):
    """Version 2 waited for the boundary while 3 was pushed: the boundary switched to 2 and 3 waited a whole task
    (with an idle boundary: two forced pauses). It stages 3 first now, and switches once (adversarial pass)."""
    from deltafs.read.pull import pull

    dest, v1_dir = staged_v1
    with WheelSGLang(v1_dir, weight_version="1") as server:
        sub = Subscriber(trainer.store, dest, engine(server), host_id="rollout-0", boundary=_Hook(trainer.push),
                         **FAST)
        sub.start()
        trainer.push()  # version 2, staged; version 3 arrives during the wait
        applied = sub.sync()
        assert applied is not None and applied.version == 3
        assert server.count("update") == 1 and server.reported_versions()[-1] == "3"
        assert same_weights(server.state_dict(), trainer.weights[3])
        sub.close()
        assert pull(trainer.store, dest).version == 3


def test_the_watcher_never_takes_the_engine_back_to_an_older_version(trainer, staged_v1):
    """A cron `pull --engine` moved the engine to version 3 while the watcher's version 2 waited for the boundary:
    at the boundary the watcher switched it back to 2 and `status` said healthy (adversarial pass). Under the
    engine lock it now asks what the engine serves and keeps a newer version."""
    dest, v1_dir = staged_v1
    with WheelSGLang(v1_dir, weight_version="1") as server:
        sub = Subscriber(trainer.store, dest, engine(server), host_id="rollout-0", **FAST)
        sub.start()
        trainer.push()
        assert sub.poll().version == 2  # staged; now the boundary wait
        trainer.push()
        from deltafs.read.pull import pull

        pull(trainer.store, dest)  # the cron run: pull, then switch the engine
        assert reload_engine("sglang", server.url, dest=dest).version == "3"
        assert sub.apply() is None  # the boundary came: nothing sent
        assert _sent(server) == [os.path.basename(os.path.realpath(dest))]
        assert server.reported_versions()[-1] == "3" and same_weights(server.state_dict(), trainer.weights[3])
        assert sub.status.served_version == 3 and sub.status.staged_version is None
        assert sub.sync() is None  # up to date
        sub.close()


@pytest.mark.parametrize("keep_mtime", [False, True])
def test_a_staged_version_changed_on_disk_while_it_waited_is_not_loaded(trainer, staged_v1, keep_mtime):
    """One byte of the staged model.safetensors was rewritten while it waited for the boundary (a stray writer):
    the engine loaded it, reported the version and status said serving (adversarial pass). The files are checked
    right before the switch; the version is staged again, verified, and then loaded. With the file's mtime put back
    (a later pass), only the hash shows it: an engine that loads from disk gets its files hashed on that read."""
    from deltafs.errors import DestinationError

    dest, v1_dir = staged_v1
    staged: list[str] = []

    def corrupt() -> None:
        if staged:
            return
        path = os.path.join(sub.staged.path, "model.safetensors")
        staged.append(path)
        before = os.stat(path)
        with open(path, "r+b") as fh:
            fh.seek(os.path.getsize(path) - 3)
            byte = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([byte[0] ^ 1]))
        if keep_mtime:
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))

    with WheelSGLang(v1_dir, weight_version="1") as server:
        sub = Subscriber(trainer.store, dest, engine(server), host_id="rollout-0", boundary=_Hook(corrupt), **FAST)
        sub.start()
        trainer.push()
        with pytest.raises(DestinationError, match="changed on disk while it waited"):
            sub.sync()
        assert server.count("update") == 0 and server.reported_versions()[-1] == "1"
        applied = sub.sync()
        assert applied is not None and applied.version == 2
        assert same_weights(server.state_dict(), trainer.weights[2])
        sub.close()


def test_an_engine_restarted_from_another_checkpoint_is_noticed_without_a_push(trainer, staged_v1, tmp_path):
    """The engine served version 2 and was restarted from other weights (it reports "default"): the watcher sent
    nothing and status said "serving 2, LAG 0" until the next push (adversarial pass). Every heartbeat it now asks
    the engine what it serves, and switches it back to the newest version."""
    from sglang_standin import random_weights, write_checkpoint

    dest, v1_dir = staged_v1
    other = write_checkpoint(str(tmp_path / "other"), random_weights(CONFIG, 7), CONFIG)
    with WheelSGLang(v1_dir, weight_version="1") as server:
        sub = Subscriber(trainer.store, dest, engine(server), host_id="rollout-0", **{**FAST, "heartbeat": 0.0})
        sub.start()
        trainer.push()
        assert sub.sync().version == 2
        # What a restart from another checkpoint looks like to the watcher (SGLang's own update code here).
        _relabel(server, other, "default")
        applied = sub.sync()
        assert applied is not None and applied.version == 2
        assert server.reported_versions()[-1] == "2" and same_weights(server.state_dict(), trainer.weights[2])
        assert sub.status.served_version == 2 and sub.sync() is None
        sub.close()


def test_a_version_that_needs_a_restart_is_reported_before_the_boundary_wait(trainer, staged_v1):
    """With an idle boundary on a busy engine, "needs a restart" was said only after --max-wait (adversarial pass):
    the boundary was waited for a switch that could not happen. The config check now runs first."""
    waited: list[bool] = []
    dest, v1_dir = staged_v1
    with WheelSGLang(v1_dir, weight_version="1") as server:
        sub = Subscriber(trainer.store, dest, engine(server), host_id="rollout-0",
                         boundary=_Hook(lambda: waited.append(True)), **FAST)
        sub.start()
        trainer.push(extra_files={"config.json": json.dumps(dict(CONFIG, rope_theta=20000.0)).encode()})
        with pytest.raises(NeedsRestartError, match="config config.json changed"):
            sub.sync()
        assert waited == [] and server.count("update") == 0
        assert ledger(trainer.store).state == "needs-restart"
        sub.close()


def test_catching_up_at_the_boundary_keeps_the_version_in_hand_when_the_newer_needs_a_restart(trainer, staged_v1):
    """Version 2 waited for the boundary; version 3, pushed meanwhile, changes config.json. Catching up staged 3,
    which cannot be hot-switched, and the engine stayed on 1 until a restart (adversarial pass on the catch-up).
    The boundary switches to 2 now; the next cycle says 3 needs the restart."""
    dest, v1_dir = staged_v1
    pushed: list[int] = []

    def push_config_change() -> None:
        if not pushed:
            pushed.append(trainer.push(extra_files={"config.json": json.dumps(dict(CONFIG, rope_theta=9.0)).encode()}))

    with WheelSGLang(v1_dir, weight_version="1") as server:
        sub = Subscriber(trainer.store, dest, engine(server), host_id="rollout-0", boundary=_Hook(push_config_change),
                         **FAST)
        sub.start()
        trainer.push()
        applied = sub.sync()
        assert applied is not None and applied.version == 2
        assert server.reported_versions()[-1] == "2" and same_weights(server.state_dict(), trainer.weights[2])
        with pytest.raises(NeedsRestartError, match="config config.json changed"):
            sub.sync()
        assert ledger(trainer.store).needs_restart["version"] == 3 and server.reported_versions()[-1] == "2"
        sub.close()


def test_an_engine_reporting_a_non_ascii_digit_does_not_crash_the_watcher(trainer, staged_v1):
    """'²'.isdigit() is true but int('²') raises: the never-backwards check crashed the watcher thread."""

    dest, v1_dir = staged_v1
    with WheelSGLang(v1_dir, weight_version="1") as server:
        sub = Subscriber(trainer.store, dest, engine(server), host_id="rollout-0", **FAST)
        sub.start()
        trainer.push()
        assert sub.poll().version == 2
        _relabel(server, v1_dir, "\u00b2")
        applied = sub.apply()
        assert applied is not None and applied.version == 2 and server.reported_versions()[-1] == "2"
        sub.close()


def test_a_group_follower_keeps_the_versions_the_engine_serves_and_loads(trainer, staged_v1, tmp_path):
    """A follower kept pulling while the group's engine loaded by-version/v2 from its disk: after three pushes its
    pull recycled that directory, and the engine's ranks there read version 5's bytes mid-load (adversarial pass).
    A follower now keeps the versions the leader's ledger entry names (served, staged) out of cleanup and recycling."""
    from safetensors.torch import load_file

    dest, v1_dir = staged_v1
    with WheelSGLang(v1_dir, weight_version="1") as server:
        leader = _leader(trainer, dest, server, **FAST)
        follower_dest = str(tmp_path / "node1-dest")
        follower = Subscriber(trainer.store, follower_dest, None, host_id="node-1", engine_group="big",
                              engine_hosts=2, keep=3, **FAST)
        leader.start()
        follower.start()
        follower.sync()  # version 1
        trainer.push()
        follower.sync()  # version 2
        assert leader.poll().version == 2  # staged: the leader's switch to it is about to send by-version/v2
        links = os.path.join(follower_dest + ".deltafs", "by-version")
        before = {v: os.path.realpath(os.path.join(links, f"v{v}")) for v in (1, 2)}
        for _ in range(3):
            trainer.push()
            follower.sync()
        for v, path in before.items():
            assert os.path.realpath(os.path.join(links, f"v{v}")) == path and os.path.isdir(path), v
            assert same_weights(load_file(os.path.join(path, "model.safetensors")), trainer.weights[v]), v
        applied = leader.apply()
        assert applied is not None and applied.version == 2
        leader.close()
        follower.close()


def test_a_new_run_at_the_same_store_url_is_loaded_although_the_engine_reports_a_higher_number(tmp_path):
    """The engine served version 3 of a run whose store was deleted and pushed again (the new run at version 2):
    the never-backwards check found the old run's version 3 beside DEST, took "3" for newer and kept the engine on
    the old run (review of the check). Only a version directory of this store counts."""
    import shutil

    from deltafs.read.pull import pull
    from watch_helpers import Trainer

    store, dest = str(tmp_path / "store"), str(tmp_path / "dest")
    old = Trainer(store, str(tmp_path / "cache-old"))
    old.push()
    v1_dir = pull(store, dest).path
    for _ in range(2):
        old.push()
    with WheelSGLang(v1_dir, weight_version="1") as server:
        sub = Subscriber(store, dest, engine(server), host_id="rollout-0", **FAST)
        sub.start()
        assert sub.sync().version == 3
        shutil.rmtree(store)
        new = Trainer(store, str(tmp_path / "cache-new"))
        for _ in range(2):
            new.push()
        sub._forget_store()  # as after a poll that found the store gone
        applied = sub.sync()
        assert applied is not None and applied.version == 2
        assert server.reported_versions()[-1] == "2" and same_weights(server.state_dict(), new.weights[2])
        sub.close()


def test_an_engine_that_reports_no_version_or_its_own_label_is_not_reloaded_at_every_heartbeat(trainer, staged_v1,
                                                                                                 caplog):
    """The heartbeat's "what do you serve?" took an engine answering None (allowed for third-party engines) or its
    own label ("default": SGLang started without --weight-version) for a restarted one: a reload per heartbeat, or a
    false warning per heartbeat (review of the check). It compares with what the engine said last."""
    import logging

    class NoVersion(SGLangEngine):
        def served_version(self):
            return None

    dest, v1_dir = staged_v1
    with WheelSGLang(v1_dir, weight_version="1") as server:
        quiet = NoVersion(server.url, timeout=2, load_timeout=10, poll_interval=0.1)
        sub = Subscriber(trainer.store, dest, quiet, host_id="rollout-0", **{**FAST, "heartbeat": 0.0})
        sub.start()
        trainer.push()
        assert sub.sync() is not None
        for _ in range(4):
            assert sub.sync() is None
        assert server.count("update") == 1
        sub.close()
    with WheelSGLang(v1_dir) as server, caplog.at_level(logging.WARNING, logger="deltafs.watch"):
        sub = Subscriber(trainer.store, dest, engine(server), host_id="rollout-1", **{**FAST, "heartbeat": 0.0})
        sub.start()
        assert server.reported_versions() == ["default"]
        sub.sync()  # switches it to version 2 (it learned version 1 from model_path)
        updates = server.count("update")
        for _ in range(4):
            assert sub.sync() is None
        assert server.count("update") == updates and "restarted?" not in caplog.text
        sub.close()


def test_a_group_boundary_switches_to_what_every_host_holds_when_the_newest_is_not_there_yet(trainer, staged_v1,
                                                                                            tmp_path):
    """Version 3 was pushed while the group's version 2 waited for the boundary: catching up staged 3, which the
    follower did not hold yet, and the boundary passed with no switch at all (review of the catch-up). It switches
    the group to 2 now; 3 follows once every host holds it."""
    dest, v1_dir = staged_v1
    with WheelSGLang(v1_dir, weight_version="1") as server:
        hook = _Hook(lambda: trainer.push() if len(trainer.weights) == 2 else None)  # version 3, once
        leader = _leader(trainer, dest, server, boundary=hook, **FAST)
        follower = Subscriber(trainer.store, str(tmp_path / "node1-dest"), None, host_id="node-1", engine_group="big",
                              engine_hosts=2, **FAST)
        leader.start()
        follower.start()
        trainer.push()
        follower.sync()  # holds version 2
        applied = leader.sync()  # version 3 arrives at the boundary; node 1 does not hold it
        assert applied is not None and applied.version == 2 and server.reported_versions()[-1] == "2"
        follower.sync()
        applied = leader.sync()
        assert applied is not None and applied.version == 3
        assert same_weights(server.state_dict(), trainer.weights[3])
        leader.close()
        follower.close()


def test_the_group_timeout_counts_from_the_first_wait_whatever_versions_arrive(trainer, staged_v1):
    """With pushes faster than a follower takes them, each new version restarted the group's wait and
    --group-timeout never reported it (review of the held-version rule)."""
    dest, v1_dir = staged_v1
    with WheelSGLang(v1_dir, weight_version="1") as server:
        leader = _leader(trainer, dest, server, group_timeout=60.0, **FAST)
        leader.start()
        trainer.push()
        with pytest.raises(GroupNotReadyError) as info:
            leader.sync()
        assert not info.value.timed_out
        leader._group_since = {v: t - 70.0 for v, t in leader._group_since.items()}  # 70 s ago
        trainer.push()  # a new version: the wait goes on, and has lasted 70 s
        with pytest.raises(GroupNotReadyError) as info:
            leader.sync()
        assert info.value.timed_out and "waited past 60s" in str(info.value) and "version 3" in str(info.value)
        leader.close()


def test_the_served_version_removed_by_another_process_is_no_restart_reason(trainer, staged_v1, monkeypatch):
    """A cron run's cleanup removed the directory of the version the watcher's engine serves while the watcher's
    check before the boundary compared it: its files read as missing, "needs an engine restart" was set and raised
    every cycle (review). A served version that goes away during the comparison is not compared."""
    import uuid

    from deltafs.engines import compat, switch

    real = compat.restart_reason

    def removed_meanwhile(served: str, new: str):
        if os.path.isdir(served):  # what a cleanup does: renamed away at once, then deleted
            os.rename(served, os.path.join(os.path.dirname(served), f"staging-{uuid.uuid4().hex[:12]}"))
        return real(served, new)

    monkeypatch.setattr(switch, "restart_reason", removed_meanwhile)
    from deltafs.watch import subscriber as subscriber_module

    monkeypatch.setattr(subscriber_module, "restart_reason", removed_meanwhile, raising=False)  # (before the fix)
    dest, v1_dir = staged_v1
    with WheelSGLang(v1_dir, weight_version="1") as server:
        sub = Subscriber(trainer.store, dest, engine(server), host_id="rollout-0", boundary=_Hook(lambda: None),
                         **FAST)
        sub.start()
        trainer.push()
        applied = sub.sync()
        assert applied is not None and applied.version == 2 and sub.status.needs_restart is None
        assert same_weights(server.state_dict(), trainer.weights[2])
        sub.close()


def test_a_group_wait_ended_without_a_switch_does_not_count_towards_the_next(trainer, staged_v1):
    """The group's wait for version 2 ended when another process moved the engine to 2; its start stayed recorded,
    and the first wait for version 3 reported the group timeout at once (review)."""
    from deltafs.read.pull import pull

    dest, v1_dir = staged_v1
    with WheelSGLang(v1_dir, weight_version="1") as server:
        leader = _leader(trainer, dest, server, group_timeout=60.0, **FAST)
        leader.start()
        trainer.push()
        with pytest.raises(GroupNotReadyError):
            leader.sync()
        leader._group_since = {v: t - 70.0 for v, t in leader._group_since.items()}  # that wait began 70 s ago
        pull(trainer.store, dest)
        assert reload_engine("sglang", server.url, dest=dest).version == "2"  # a cron run
        assert leader.apply() is None  # the engine serves 2 already
        trainer.push()
        with pytest.raises(GroupNotReadyError) as info:
            leader.sync()
        assert not info.value.timed_out, str(info.value)
        leader.close()


def test_the_heartbeat_check_does_not_hold_the_engine_lock_over_its_request(trainer, staged_v1):
    """It held DEST's engine lock for the whole served_version() request (up to the engine's timeout), turning a
    cron reload away as busy in the meantime (review)."""
    from deltafs.errors import LockHeldError
    from deltafs.read.dest import LocalCheckpoint

    dest, v1_dir = staged_v1
    seen: list[str] = []

    class Probing(SGLangEngine):
        def served_version(self):
            try:
                with LocalCheckpoint(dest).lock(wait=False, name="engine.lock"):
                    seen.append("free")
            except LockHeldError:
                seen.append("held")
            return super().served_version()

    with WheelSGLang(v1_dir, weight_version="1") as server:
        probing = Probing(server.url, timeout=2, load_timeout=10, poll_interval=0.1)
        sub = Subscriber(trainer.store, dest, probing, host_id="rollout-0", **{**FAST, "heartbeat": 0.0})
        sub.start()
        seen.clear()
        for _ in range(3):
            assert sub.sync() is None
        assert seen and set(seen) == {"free"}, seen
        sub.close()


def test_a_new_runs_version_with_the_number_the_engine_serves_is_loaded(tmp_path, monkeypatch):
    """The engine served version 1 of a run whose store was deleted and pushed again by a new run (other weights),
    also at version 1: DEST then holds a version 1 of each store, and the never-backwards check took whichever
    directory came first for what the engine holds; when that was the new run's, it kept the engine on the old run's
    weights for good. The engine's model_path tells the two apart."""
    import shutil
    import uuid

    from deltafs.read import dest as dest_module
    from deltafs.read.pull import pull
    from watch_helpers import Trainer

    store, dest = str(tmp_path / "store"), str(tmp_path / "dest")
    old = Trainer(store, str(tmp_path / "cache-old"))
    old.push()
    v1_dir = pull(store, dest).path
    with WheelSGLang(v1_dir, weight_version="1") as server:
        sub = Subscriber(store, dest, engine(server), host_id="rollout-0", **FAST)
        sub.start()
        assert sub.sync() is None and sub.status.served_version == 1
        shutil.rmtree(store)
        new = Trainer(store, str(tmp_path / "cache-new"))
        new._current = {k: v + 1 for k, v in new._current.items()}
        new.push()
        # The new run's directory sorts after the old one's (its name ends in 8 random hex digits).
        real = uuid.uuid4
        monkeypatch.setattr(dest_module.uuid, "uuid4", lambda: uuid.UUID(int=(0xFFFFFFFF << 96) | real().int >> 32))
        sub._forget_store()  # as after a poll that found the store gone
        applied = sub.sync()
        assert applied is not None and applied.version == 1
        assert same_weights(server.state_dict(), new.weights[1])
        sub.close()


def test_an_engine_restarted_from_other_weights_under_the_same_label_is_reloaded(trainer, staged_v1, tmp_path):
    """An operator restarted the engine with `--model-path /elsewhere --weight-version 1`: the watcher believed the
    number, status said serving 1, lag 0, and the engine kept the other weights for good (adversarial pass). The
    number counts only with the model_path that goes with it: at start, and at every heartbeat."""
    from sglang_standin import random_weights, write_checkpoint

    dest, v1_dir = staged_v1
    wrong = write_checkpoint(str(tmp_path / "wrong"), random_weights(CONFIG, 99), CONFIG)
    with WheelSGLang(wrong, weight_version="1") as server:
        sub = Subscriber(trainer.store, dest, engine(server), host_id="rollout-0", **{**FAST, "heartbeat": 0.0})
        sub.start()
        applied = sub.sync()
        assert applied is not None and applied.version == 1
        assert same_weights(server.state_dict(), trainer.weights[1])
        sub.close()


@pytest.mark.parametrize("answers_none_between", [False, True])
def test_a_restart_from_other_weights_under_the_served_label_is_noticed_at_the_heartbeat(trainer, staged_v1,
                                                                                         tmp_path,
                                                                                         answers_none_between):
    """... also when a heartbeat in between got no answer (None: the engine restarting), which must not become what
    the next answer is compared with (review)."""
    from sglang_standin import random_weights, write_checkpoint

    dest, v1_dir = staged_v1
    wrong = write_checkpoint(str(tmp_path / "wrong"), random_weights(CONFIG, 99), CONFIG)
    with WheelSGLang(v1_dir, weight_version="1") as server:
        sub = Subscriber(trainer.store, dest, engine(server), host_id="rollout-0", **{**FAST, "heartbeat": 0.0})
        sub.start()
        assert sub.sync() is None and sub.status.served_version == 1
        if answers_none_between:
            real = sub.engine.served_version
            sub.engine.served_version = lambda: None
            sub._check_engine()
            sub.engine.served_version = real
        # What a restart with `--model-path WRONG --weight-version 1` leaves: another directory, the same label.
        _relabel(server, wrong, "1")
        sub._check_engine()
        applied = sub.sync()
        assert applied is not None and applied.version == 1
        assert same_weights(server.state_dict(), trainer.weights[1])
        sub.close()


def test_dest_pointed_back_by_hand_while_a_version_waited_is_pointed_at_the_one_served(trainer, staged_v1):
    """DEST was pointed back at version 1 by hand while version 2 waited for the boundary: the engine went to 2,
    DEST stayed on 1 for good, status and `verify --local` said ok, and `launch-args` would restart the engine on 1
    (adversarial pass). After the switch DEST names the version served."""
    from deltafs.read.dest import LocalCheckpoint
    from deltafs.read.pull import local_version

    dest, v1_dir = staged_v1

    def repoint() -> None:
        LocalCheckpoint(dest).point_to(os.path.basename(v1_dir))

    with WheelSGLang(v1_dir, weight_version="1") as server:
        sub = Subscriber(trainer.store, dest, engine(server), host_id="rollout-0", boundary=_Hook(repoint), **FAST)
        sub.start()
        trainer.push()
        applied = sub.sync()
        assert applied is not None and applied.version == 2
        assert server.reported_versions()[-1] == "2" and local_version(dest).version == 2
        sub.close()
