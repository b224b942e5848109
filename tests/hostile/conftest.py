"""Helpers for the hostile suite: the real `deltafs` console command, and a store with a version."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any

import pytest

from deltafs.publish import push


def deltafs(*args: Any, cwd: Any = None, check: int | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the installed `deltafs` command as a user would (not python -m)."""
    exe = shutil.which("deltafs", path=os.path.dirname(sys.executable))
    assert exe, "the deltafs console script is not installed next to this python"
    proc = subprocess.run([exe, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=timeout)
    if check is not None:
        assert proc.returncode == check, (proc.returncode, proc.stdout, proc.stderr)
    return proc


def one_line(proc: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    """Assert exit code `code` and a one-line error on stderr containing every needle."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture
def store(tmp_path: Any, maker: Any) -> str:
    """A local store holding version 1 of the maker's checkpoint."""
    url = str(tmp_path / "store")
    push(url, maker.write())
    return url
