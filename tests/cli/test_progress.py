"""Progress bars show on a terminal only, never with --json or --quiet or when piped."""

from __future__ import annotations

import os
import pty
import subprocess
import sys

import numpy as np

from deltafs.store.repo import Repository
from deltafs.testing.checkpoints import random_bytes, write_safetensors


def _run_on_tty(args, env):
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "deltafs.cli.main", *map(str, args)], stdin=slave, stdout=slave,
                            stderr=slave, env=env, close_fds=True)
    os.close(slave)
    out = b""
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:
            break
        if not data:
            break
        out += data
    proc.wait(timeout=60)
    os.close(master)
    return proc.returncode, out.decode(errors="replace")


def _source(tmp_path):
    rng = np.random.default_rng(0)
    src = tmp_path / "src"
    write_safetensors(str(src / "model.safetensors"), {f"t{i}": ("U8", (1 << 20,), random_bytes(rng, 1 << 20)) for i in range(24)})
    return src


def test_progress_bar_on_a_terminal_only(tmp_path):
    src = _source(tmp_path)
    store = tmp_path / "store"
    Repository.open(str(store), create=True, chunk_bytes=64 << 10)
    env = {**os.environ, "TERM": "xterm", "COLUMNS": "120"}
    rc, shown = _run_on_tty(["push", src, store, "--threads", "1"], env)
    assert rc == 0 and "push v1" in shown and "pushed version 1" in shown
    assert "MB/s" not in shown and " MB" not in shown  # binary units, as the result lines use
    rc, shown = _run_on_tty(["pull", store, tmp_path / "dest", "--threads", "1"], env)
    assert rc == 0 and "pull v1" in shown
    rc, shown = _run_on_tty(["pull", store, tmp_path / "dest2", "--json"], env)
    assert rc == 0 and "pull v1" not in shown and shown.strip().startswith("{")
    piped = subprocess.run([sys.executable, "-m", "deltafs.cli.main", "pull", str(store), str(tmp_path / "dest3")],
                           capture_output=True, text=True, env=env)
    assert piped.returncode == 0 and "pull v1" not in piped.stderr
