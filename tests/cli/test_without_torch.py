"""The core install has no torch: push, pull, verify, log and gc run with torch impossible to import."""

from __future__ import annotations

import json
import os

from deltafs.testing.checkpoints import files_of, run_cli


def _no_torch_env(tmp_path) -> dict[str, str]:
    """A PYTHONPATH whose first entry holds a `torch` package that refuses to import."""
    blocker = tmp_path / "blocker" / "torch"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('torch is not installed (blocked by the test)')\n")
    path = [str(tmp_path / "blocker")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join(path)}


def test_cli_core_commands_without_torch(tmp_path, maker):
    env = _no_torch_env(tmp_path)
    probe = run_cli("--help", env=env, check=0)
    assert "push" in probe.stdout
    store, dest = tmp_path / "store", tmp_path / "dest"
    run_cli("push", maker.write(), store, env=env, check=0)
    maker.advance()
    src = maker.write()
    assert json.loads(run_cli("push", src, store, "--json", env=env, check=0).stdout)["kind"] == "delta"
    assert json.loads(run_cli("pull", store, dest, "--json", env=env, check=0).stdout)["version"] == 2
    assert files_of(dest) == files_of(src)
    assert json.loads(run_cli("verify", store, "--all", "--json", env=env, check=0).stdout)["ok"] is True
    assert len(json.loads(run_cli("log", store, "--json", env=env, check=0).stdout)["versions"]) == 2
    run_cli("gc", store, "--keep-last", "1", "--grace", "0", env=env, check=0)


def test_the_blocker_really_blocks(tmp_path):
    """Guard for the test above: with the blocker first on the path, importing torch fails."""
    import subprocess
    import sys

    env = dict(os.environ, **_no_torch_env(tmp_path))
    proc = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True, env=env)
    assert proc.returncode != 0 and "blocked by the test" in proc.stderr
