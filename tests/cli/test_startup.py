"""Commands that do no numeric work start without numpy, zstandard, xxhash, torch or fsspec.

Each of those costs start-up time on every call (docs/cli_startup.md); `deltafs --help` once imported
all but torch because the push defaults were read from the module that uses them.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = {"numpy", "zstandard", "xxhash", "torch", "fsspec"}


def imported(*args: object) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run the command line as `python -X importtime -m deltafs.cli.main ARGS`; the modules it imported."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "deltafs.cli.main", *map(str, args)],
                          capture_output=True, text=True, timeout=120)
    names = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    return proc, names


@pytest.mark.parametrize("args", [["--help"], ["version"], ["push", "--help"], ["pull", "--help"], ["watch", "--help"],
                                  ["gc", "--help"]], ids=" ".join)
def test_help_and_version_import_no_numeric_library(args):
    proc, names = imported(*args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip()
    assert not names & HEAVY, f"deltafs {' '.join(args)} imported {sorted(names & HEAVY)}"


def test_log_reads_the_store_without_numpy(tmp_path, maker):
    store = tmp_path / "store"
    push, pushed = imported("push", maker.write(), store)
    assert push.returncode == 0, push.stderr[-2000:]
    assert "numpy" in pushed  # the check sees a heavy import where there is one
    proc, names = imported("log", store)
    assert proc.returncode == 0 and "(HEAD)" in proc.stdout
    # Manifests are zstd frames; nothing numeric is needed.
    assert not names & {"numpy", "xxhash", "torch"}


def test_a_local_store_never_loads_fsspec_or_asyncio(tmp_path, maker):
    """fsspec (and the asyncio it loads) cost ~45 ms of every start; a store on a local path needs neither."""
    store, dest = tmp_path / "store", tmp_path / "dest"
    for args in (("push", maker.write(), store), ("pull", store, dest), ("log", store), ("verify", store),
                 ("gc", store, "--keep-last", "1", "--dry-run")):
        proc, names = imported(*args)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "deltafs.store.local" in names  # the check sees the store being opened
        assert not names & {"fsspec", "asyncio"}, f"deltafs {args[0]} imported {sorted(names & {'fsspec', 'asyncio'})}"


def test_a_remote_url_still_loads_fsspec(tmp_path):
    proc, names = imported("log", "memory://deltafs-startup-test")
    assert "fsspec" in names, proc.stderr[-2000:]
