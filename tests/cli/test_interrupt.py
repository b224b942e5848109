"""SIGTERM ends a one-shot command as Ctrl-C does: exit 130, "interrupted", nothing half-done left visible."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

from deltafs.read.dest import LocalCheckpoint
from deltafs.testing.checkpoints import run_cli

MAIN = "import sys; from deltafs.cli.main import main; sys.argv[0] = 'deltafs'; main()"


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", MAIN, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for(proc: subprocess.Popen, text: str, timeout: float = 30) -> str:
    """stderr until it holds text (the process is then where that line says), the process ends, or timeout."""
    seen = b""
    fd = proc.stderr.fileno()
    deadline = time.monotonic() + timeout
    while text.encode() not in seen and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            seen += chunk
    return seen.decode()


def test_a_pull_waiting_for_another_pull_says_so_and_sigterm_ends_it_with_130(tmp_path, maker):
    """SIGTERM (timeout, systemd) killed a plain pull with 143 and no word, where README's table says 130; and a
    pull waiting for another pull's lock waited without a word (review of the docs)."""
    store, dest = str(tmp_path / "store"), str(tmp_path / "dest")
    assert run_cli("push", maker.write(), store).returncode == 0
    assert run_cli("pull", store, dest).returncode == 0
    assert run_cli("push", maker.write(), store).returncode == 0
    with LocalCheckpoint(dest).lock():  # another pull on DEST
        proc = _start("pull", store, dest)
        seen = _wait_for(proc, "waiting for it to finish", timeout=20)
        proc.send_signal(signal.SIGTERM)
        _out, rest = proc.communicate(timeout=30)
    err = seen + rest.decode()
    assert f"another deltafs process is updating {dest}; waiting for it to finish" in seen, seen
    assert proc.returncode == 130, err
    assert "deltafs: interrupted" in err and "Traceback" not in err
    from deltafs.read.pull import local_version

    assert local_version(dest).version == 1  # DEST untouched
    assert not [n for n in os.listdir(dest + ".deltafs") if n.startswith("staging-")]

