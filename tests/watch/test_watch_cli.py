"""`deltafs watch` as a real process: --once exit codes, SIGTERM mid-switch, SIGUSR1 boundary."""

from __future__ import annotations

import pytest
import os
import signal
import subprocess
import sys
import time

from watch_helpers import same_weights, wait_until

from deltafs.store.open import open_objects
from deltafs.watch.ledger import HostStatus, ledger_key

MAIN = "import sys; from deltafs.cli.main import main; sys.argv[0] = 'deltafs'; main()"


def deltafs(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", MAIN, *args], capture_output=True, text=True, timeout=60, **kw)


def start_watch(tmp_path, *args: str) -> tuple[subprocess.Popen, str]:
    log = str(tmp_path / "watch.log")
    fh = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-c", MAIN, "watch", *args], stdout=fh, stderr=subprocess.STDOUT)
    return proc, log


def ledger(store: str, host: str) -> HostStatus | None:
    try:
        return HostStatus.from_bytes(open_objects(store).get(ledger_key(host)))
    except FileNotFoundError:
        return None


def test_once_applies_then_is_a_no_op(trainer, tmp_path, engine_server):
    trainer.push()
    dest = str(tmp_path / "dest")
    args = ["watch", trainer.store, dest, "--engine-url", engine_server.url, "--once", "--host-id", "h1"]
    first = deltafs(*args)
    assert first.returncode == 0, first.stderr
    assert "version 1 live" in first.stderr and "pause" in first.stderr
    assert same_weights(engine_server.state_dict(), trainer.weights[1])
    updates = engine_server.count("update")
    second = deltafs(*args)
    assert second.returncode == 0 and engine_server.count("update") == updates
    # One cycle leaves the host serving in the ledger: "stopped" hid a daemon beside it (and a stopped host is
    # never reported stale, so one that died later looked healthy).
    assert ledger(trainer.store, "h1").state == "serving"


def test_once_with_the_engine_down_fails_with_the_engine_exit_code(trainer, tmp_path, engine_server):
    trainer.push()
    engine_server.stop()
    result = deltafs("watch", trainer.store, str(tmp_path / "dest"), "--engine-url", engine_server.url, "--once")
    assert result.returncode == 10
    # One line with the reason, not urllib3's nested repr cut at 200 characters (as the README promises).
    assert result.stderr.splitlines()[-1].endswith(f"cannot reach SGLang at {engine_server.url}: connection refused")


def test_pull_with_an_engine_url_alone_reloads_sglang_as_watch_does(trainer, tmp_path, engine_server):
    """`pull --engine-url URL` without --engine pulled and never touched the engine (exit 0, nothing said)."""
    trainer.push()
    dest = str(tmp_path / "dest")
    result = deltafs("pull", trainer.store, dest, "--engine-url", engine_server.url)
    assert result.returncode == 0, result.stderr
    assert engine_server.weight_version == "1" and engine_server.count("update") == 1
    engine_server.stop()
    trainer.push()
    down = deltafs("pull", trainer.store, dest, "--engine-url", engine_server.url)
    assert down.returncode == 10 and "cannot reach SGLang" in down.stderr


@pytest.mark.parametrize("args, words", [
    (["--boundary", "signal", "--boundary-port", "99999"], "--boundary-port must be a port number, 1..65535, not 99999"),
    (["--boundary", "signal", "--boundary-port", "-1"], "--boundary-port must be a port number"),
    (["--engine-group", "g", "--engine-hosts", "0"], "--engine-hosts must be at least 1, not 0"),
    # A boundary option given with another boundary kind was ignored without a word (review of the docs).
    (["--boundary-file", "/tmp/x"], "--boundary-file applies to --boundary signal, not immediate"),
    (["--boundary", "idle", "--boundary-port", "7000"], "--boundary-port applies to --boundary signal, not idle"),
    (["--max-wait", "5"], "--max-wait applies to --boundary idle, not immediate"),
    (["--boundary", "signal", "--max-wait", "5"], "--max-wait applies to --boundary idle, not signal"),
])
def test_bad_watch_numbers_are_usage_errors(trainer, tmp_path, args, words):
    trainer.push()
    result = deltafs("watch", trainer.store, str(tmp_path / "dest"), "--once", *args)
    assert result.returncode == 2 and words in result.stderr.splitlines()[-1], result.stderr


def test_a_boundary_port_in_use_is_a_usage_error_naming_it(trainer, tmp_path):
    import socket

    trainer.push()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = deltafs("watch", trainer.store, str(tmp_path / "dest"), "--boundary", "signal", "--boundary-port",
                         str(port), "--once")
    assert result.returncode == 2 and f"--boundary-port {port}: cannot listen on 127.0.0.1:{port}" in result.stderr


def test_sigterm_during_a_switch_finishes_it_and_resumes_the_engine(trainer, tmp_path, engine_server):
    trainer.push()
    proc, log = start_watch(tmp_path, trainer.store, str(tmp_path / "dest"), "--engine-url", engine_server.url,
                            "--host-id", "h1", "--load-timeout", "20")
    try:
        wait_until(lambda: engine_server.weight_version == "1" and not engine_server.paused, timeout=20)
        engine_server.inject("hang", seconds=1.5)
        trainer.push()
        wait_until(lambda: engine_server.paused, timeout=20, what="the switch to version 2 in progress")
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=20)
    finally:
        proc.kill()
    assert rc == 0, open(log).read()
    assert not engine_server.paused
    assert engine_server.weight_version == "2"
    assert same_weights(engine_server.state_dict(), trainer.weights[2])
    assert ledger(trainer.store, "h1").state == "stopped"


def test_sigterm_while_idle_exits_promptly(trainer, tmp_path, engine_server):
    trainer.push()
    proc, log = start_watch(tmp_path, trainer.store, str(tmp_path / "dest"), "--engine-url", engine_server.url,
                            "--host-id", "h1")
    try:
        wait_until(lambda: (ledger(trainer.store, "h1") or HostStatus("", "", "")).served_version == 1, timeout=20)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=10)
    finally:
        proc.kill()
    assert rc == 0 and time.monotonic() - started < 10, open(log).read()  # not after a 30 s poll


def test_signal_boundary_by_sigusr1(trainer, tmp_path, engine_server):
    trainer.push()
    proc, log = start_watch(tmp_path, trainer.store, str(tmp_path / "dest"), "--engine-url", engine_server.url,
                            "--host-id", "h1", "--boundary", "signal")
    try:
        wait_until(lambda: (ledger(trainer.store, "h1") or HostStatus("", "", "")).state == "waiting", timeout=20)
        time.sleep(0.3)
        assert engine_server.count("update") == 0  # staged, waiting for the orchestrator
        os.kill(proc.pid, signal.SIGUSR1)
        wait_until(lambda: engine_server.weight_version == "1", timeout=20)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
    assert same_weights(engine_server.state_dict(), trainer.weights[1])


def test_sigterm_while_degraded_exits_with_the_error_code(trainer, tmp_path, engine_server):
    trainer.push()
    engine_server.stop()
    proc, log = start_watch(tmp_path, trainer.store, str(tmp_path / "dest"), "--engine-url", engine_server.url,
                            "--host-id", "h1")
    try:
        wait_until(lambda: (ledger(trainer.store, "h1") or HostStatus("", "", "")).failures >= 1, timeout=20)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=20)
    finally:
        proc.kill()
    text = open(log).read()
    assert rc == 10, text  # EngineError: the engine could not be switched
    assert "cannot reach SGLang" in text and "Traceback" not in text
    assert ledger(trainer.store, "h1").state == "stopped"


def test_engineless_watch_says_so_and_writes_metrics(trainer, tmp_path):
    trainer.push()
    trainer.push()
    mdir = tmp_path / "metrics"
    env = {**os.environ, "DELTAFS_METRICS_DIR": str(mdir)}
    result = deltafs("watch", trainer.store, str(tmp_path / "dest"), "--engine", "none", "--once", env=env)
    assert result.returncode == 0, result.stderr
    assert "live on none" not in result.stderr and "(no engine to switch)" in result.stderr
    text = (mdir / "deltafs_watch.prom").read_text()
    assert "deltafs_watch_switches_total{" in text and "deltafs_watch_served_version{" in text
    served = [ln for ln in text.splitlines() if ln.startswith("deltafs_watch_served_version{")]
    assert served and served[0].endswith(" 2")


def test_watch_refuses_a_dest_that_is_not_a_deltafs_checkpoint(trainer, tmp_path):
    """Only another store's deltafs checkpoint is replaced unasked; a directory of other files, a file, or a link
    deltafs did not make (a typo in a unit file) is refused as pull refuses it (exit 9), and nothing is moved."""
    trainer.push()
    project = tmp_path / "project"
    (project / "sub").mkdir(parents=True)
    (project / "sub" / "notes.txt").write_text("mine\n")
    plain = tmp_path / "outside.txt"
    plain.write_text("mine\n")
    for dest in (project, plain):
        result = deltafs("watch", trainer.store, str(dest), "--engine", "none", "--once")
        assert result.returncode == 9, result.stderr
        assert "use --force to move it aside" in result.stderr
        sidecar = str(dest) + ".deltafs"
        assert not os.path.islink(dest)
        assert not os.path.isdir(sidecar) or not [n for n in os.listdir(sidecar) if n.startswith("displaced-")]
    assert (project / "sub" / "notes.txt").read_text() == "mine\n" and plain.read_text() == "mine\n"
    assert sorted(os.listdir(project)) == ["sub"]
