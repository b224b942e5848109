"""A gc killed with SIGKILL at any point leaves a store that verifies; the next gc finishes the job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from deltafs.maintenance.gc import gc
from deltafs.maintenance.verify import verify
from deltafs.read.pull import pull
from deltafs.store.repo import Repository
from deltafs.testing.checkpoints import files_of

from history_helpers import push_history

# Runs a real gc in a child process and parks it (forever) just before its N-th delete.
_CHILD = textwrap.dedent("""
    import sys, time
    from deltafs.maintenance.gc import gc
    stop_at, seen = int(sys.argv[2]), []
    def hook(key):
        seen.append(key)
        if len(seen) == stop_at:
            print("parked before " + key, flush=True)
            time.sleep(3600)
    gc(sys.argv[1], keep_last=2, grace=0, settle=0, threads=1, on_delete=hook)
    print("finished", flush=True)
""")


@pytest.mark.parametrize("stop_at", [1, 2, 5, 9])  # the bridge of 4, then 6 manifests (newest first), then chunks
def test_killed_gc_leaves_a_consistent_store(tmp_path, maker, stop_at):
    store = str(tmp_path / "store")
    srcs = push_history(store, maker, 8, keyframe_every=3)  # full 1, 4, 7; keep 7, 8; remove 6..1
    dry = gc(store, keep_last=2, grace=0, dry_run=True).plan
    assert dry.remove == [6, 5, 4, 3, 2, 1] and list(dry.bridges) == [4]  # 7 keeps its bridge
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, store, str(stop_at)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("parked before"), line
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    repo = Repository.open(store)
    left = repo.versions()
    assert 7 in left and 8 in left
    if stop_at <= 7:
        assert len(left) == 8 - max(0, stop_at - 2)  # killed at the bridge or among the manifests
    else:
        assert left == [7, 8] and gc(store, keep_last=2, grace=0, dry_run=True).plan.chunks  # among the chunks
    assert verify(store, all_versions=True).ok, verify(store, all_versions=True).problems
    for v in left:  # every version still listed can be pulled, byte for byte
        dest = tmp_path / f"d{v}"
        pull(store, str(dest), version=v)
        assert files_of(dest) == files_of(srcs[v])
    # The killed gc's lock names a dead process on this host: the next gc takes it over and finishes.
    res = gc(store, keep_last=2, grace=0, settle=0)
    assert res.executed
    assert Repository.open(store).versions() == [7, 8]
    assert verify(store, all_versions=True).ok
    again = gc(store, keep_last=2, grace=0, dry_run=True)
    assert again.plan.remove == [] and again.plan.chunks == {}  # no orphans left
