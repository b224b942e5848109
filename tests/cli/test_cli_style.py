"""The command line in the style users know from `hf`: help, version, completion, one-line errors."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from deltafs.testing.checkpoints import run_cli, write_safetensors

COMMANDS = ["push", "pull", "verify", "log", "watch", "status", "gc", "show", "diff", "version", "env"]


def _console() -> str:
    """The installed `deltafs` console script next to this interpreter."""
    path = os.path.join(os.path.dirname(sys.executable), "deltafs")
    assert os.path.exists(path), "the deltafs console script is not installed in this environment"
    return path


def test_console_script_help_version_and_bare_call():
    exe = _console()
    for args in (["-h"], ["--help"], []):
        proc = subprocess.run([exe, *args], capture_output=True, text=True)
        assert proc.returncode == 0 and "Usage: deltafs" in proc.stdout and "push" in proc.stdout, args
    for args in (["--version"], ["-V"], ["version"]):
        proc = subprocess.run([exe, *args], capture_output=True, text=True)
        assert proc.returncode == 0 and re.fullmatch(r"deltafs \d+\.\d+\.\d+\S*\n", proc.stdout), (args, proc.stdout)
    env = subprocess.run([exe, "env"], capture_output=True, text=True, check=True).stdout
    assert "deltafs: " in env and "python: " in env and "zstandard: " in env
    from deltafs.codec import native

    assert ("codec loops: compiled" if native.BUILT else "codec loops: numpy (not built") in env, env
    from deltafs import buffers

    assert ("large chunks: read through guarded mappings" if buffers._mapped is not None
            else "large chunks: read with pread") in env, env
    off = subprocess.run([exe, "env"], capture_output=True, text=True, check=True,
                         env={**os.environ, "DELTAFS_NATIVE": "0"}).stdout
    assert "codec loops: numpy (" in off and "DELTAFS_NATIVE: 0" in off, off


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_examples(command):
    proc = run_cli(command, "-h", check=0)
    assert "Examples:" in proc.stdout, proc.stdout


def test_arguments_have_help_text():
    text = run_cli("push", "--help", check=0).stdout
    assert "A .safetensors file or an HF checkpoint directory" in text and "Store URL" in text


def test_one_did_you_mean_and_exit_2():
    proc = run_cli("pul")
    assert proc.returncode == 2 and proc.stderr.count("Did you mean 'pull'?") == 1


def test_shell_completion_completes_commands():
    env = dict(os.environ, _DELTAFS_COMPLETE="complete_bash", COMP_WORDS="deltafs pu", COMP_CWORD="1")
    proc = subprocess.run([_console()], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and set(proc.stdout.split()) == {"push", "pull"}


def test_engine_is_checked_before_anything_is_pulled(tmp_path, maker):
    store, dest = tmp_path / "store", tmp_path / "dest"
    run_cli("push", maker.write(), store, "-q", check=0)
    bad = run_cli("pull", store, dest, "--engine", "sglng", "--engine-url", "http://127.0.0.1:9")
    assert bad.returncode == 2 and "unknown engine 'sglng'" in bad.stderr and len(bad.stderr.splitlines()) == 1
    assert not os.path.lexists(dest) and not os.path.lexists(f"{dest}.deltafs")


def test_ctrl_c_prints_one_line_and_exits_130(tmp_path):
    rng = np.random.default_rng(0)
    src = tmp_path / "src"
    write_safetensors(str(src / "model.safetensors"),
                      {f"t{i}": ("U8", (16 << 20,), rng.integers(0, 255, 16 << 20, dtype=np.uint8).tobytes()) for i in range(8)})
    # zstd level 19 over 128 MiB of random bytes takes ~15 s of one core, so the signal always lands while the push
    # is encoding. A first push stores its chunks at --full-level (--level is a delta's): at the default full level
    # it took 0.6 s, and under load it could finish between the store's creation and the signal (a CI run did).
    proc = subprocess.Popen([_console(), "push", str(src), str(tmp_path / "store"), "--threads", "1",
                             "--full-level", "19"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(tmp_path / "store" / "deltafs.json") and time.monotonic() < deadline:
        time.sleep(0.05)  # wait until the push is under way
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err == "deltafs: interrupted\n", (proc.returncode, err)
    assert not os.path.exists(tmp_path / "store" / "HEAD")  # nothing was committed
    shutil.rmtree(tmp_path / "store", ignore_errors=True)
