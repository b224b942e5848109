"""SIGKILL a real push or pull process at chosen and at random points: the store and DEST stay consistent."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from deltafs.maintenance.verify import verify
from deltafs.read.pull import local_version, pull
from deltafs.store.repo import Repository
from deltafs.testing.checkpoints import files_of, perturb, random_bytes, write_safetensors

# Runs the real CLI in a child process, after arranging for it to SIGKILL itself at one point.
DRIVER = textwrap.dedent(
    """
    import os, signal, sys
    point, count = sys.argv[1], int(sys.argv[2])
    calls = {"n": 0}
    def die_after(obj, name):
        orig = getattr(obj, name)
        def wrapper(*a, **k):
            calls["n"] += 1
            if calls["n"] > count:
                os.kill(os.getpid(), signal.SIGKILL)
            return orig(*a, **k)
        setattr(obj, name, wrapper)
    from deltafs.store.repo import Repository
    from deltafs.read.dest import LocalCheckpoint
    from deltafs.read import rebuild
    if point == "chunk":       die_after(Repository, "put_chunk")       # after `count` chunks are stored
    elif point == "head":      die_after(Repository, "advance_head")    # manifest committed, HEAD not moved
    elif point == "cache":     die_after(LocalCheckpoint, "install")    # version committed, push cache not updated
    elif point == "fetch":     die_after(rebuild.ChunkSource, "get")    # pull: after `count` chunks fetched
    elif point == "replace":   die_after(os, "replace")                 # pull: around the rename and the symlink flip
    sys.argv = ["deltafs"] + sys.argv[3:]
    from deltafs.cli.main import main
    main()
    """
)


def _kill_at(point: str, count: int, *args: str) -> int:
    proc = subprocess.run([sys.executable, "-c", DRIVER, point, str(count), *map(str, args)], capture_output=True, text=True,
                          timeout=120)
    return proc.returncode


def _big_checkpoint(path, rng, tensors=None):
    tensors = tensors or {f"layer.{i}.weight": ("BF16", (256, 512), random_bytes(rng, 256 * 512 * 2)) for i in range(6)}
    write_safetensors(str(path / "model.safetensors"), tensors)
    (path / "config.json").write_text('{"hidden": 512}')
    return tensors


def _next(tensors, rng):
    return {n: (d, s, perturb(b, 2, 0.01, rng)) for n, (d, s, b) in tensors.items()}


@pytest.fixture
def store(tmp_path):
    path = str(tmp_path / "store")
    Repository.open(path, create=True, chunk_bytes=64 << 10)  # many chunks: many places to die
    return path


@pytest.mark.parametrize("point,count,cache", [("chunk", 0, "link"), ("chunk", 5, "link"), ("chunk", 20, "link"),
                                               ("head", 0, "link"), ("cache", 0, "link"), ("chunk", 5, "patch"),
                                               ("chunk", 20, "patch"), ("cache", 0, "patch")])
def test_push_killed_leaves_previous_or_new_version(tmp_path, store, point, count, cache):
    rng = np.random.default_rng(3)
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    t1 = _big_checkpoint(v1, rng)
    _big_checkpoint(v2, rng, _next(t1, rng))
    if cache == "patch":
        # As after a trainer was seen rewriting a file in place: the push cache may not link the new files, so
        # the push of v2 writes the changed chunks into the cached v1's own files, and is killed while at it.
        from deltafs.publish.plan import default_cache_dir

        root = default_cache_dir(Repository.open(store).store_id)
        os.makedirs(root)
        open(os.path.join(root, "no-link"), "w").close()
    subprocess.run([sys.executable, "-m", "deltafs.cli.main", "push", str(v1), store, "-q"], check=True)
    if cache == "patch":
        cached = os.path.join(root, "base", "model.safetensors")
        assert os.stat(cached).st_nlink == 1 and os.stat(cached).st_ino != os.stat(v1 / "model.safetensors").st_ino
    rc = _kill_at(point, count, "push", v2, store, "-q")
    assert rc == -signal.SIGKILL
    if cache == "patch":  # half-patched files are never a cached version
        from deltafs.read.dest import LocalCheckpoint

        assert LocalCheckpoint(os.path.join(root, "base")).state() is None
    repo = Repository.open(store)
    head = repo.head()
    # Killed before the manifest: still version 1. Killed after it: version 2 is complete and visible.
    assert head.version == (2 if point in ("head", "cache") else 1)
    assert verify(store, all_versions=True).ok
    dest = str(tmp_path / "dest")
    pull(store, dest)
    assert files_of(dest) == files_of(v1 if head.version == 1 else v2)
    # The next push works, from a push cache that may be stale: it re-derives its base from the store.
    v3 = tmp_path / "v3"
    _big_checkpoint(v3, rng, _next(t1, rng))
    subprocess.run([sys.executable, "-m", "deltafs.cli.main", "push", str(v3), store, "-q"], check=True)
    pull(store, dest)
    assert files_of(dest) == files_of(v3)
    assert verify(store, all_versions=True).ok


@pytest.mark.parametrize("point,count", [("fetch", 3), ("fetch", 15), ("replace", 0), ("replace", 1), ("replace", 2)])
def test_pull_killed_leaves_old_version_in_place(tmp_path, store, point, count):
    rng = np.random.default_rng(4)
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    t1 = _big_checkpoint(v1, rng)
    _big_checkpoint(v2, rng, {n: (d, s, random_bytes(rng, len(b))) for n, (d, s, b) in t1.items()})  # all new
    subprocess.run([sys.executable, "-m", "deltafs.cli.main", "push", str(v1), store, "-q"], check=True)
    dest = str(tmp_path / "dest")
    pull(store, dest)
    subprocess.run([sys.executable, "-m", "deltafs.cli.main", "push", str(v2), store, "-q"], check=True)
    rc = _kill_at(point, count, "pull", store, dest, "-q")
    assert rc == -signal.SIGKILL
    state = local_version(dest)
    assert state.version in (1, 2)
    assert files_of(dest) == files_of(v1 if state.version == 1 else v2)
    assert verify(store, local=dest).ok
    res = pull(store, dest)
    assert files_of(dest) == files_of(v2)
    # A local store is read again rather than copied beside DEST: no chunk cache takes disk space there.
    assert not os.path.exists(dest + ".deltafs/chunks")
    assert res.updated


def test_random_kills_of_push_and_pull(tmp_path, store):
    rng = np.random.default_rng(5)
    pick = random.Random(11)
    tensors = _big_checkpoint(tmp_path / "v0", rng)
    subprocess.run([sys.executable, "-m", "deltafs.cli.main", "push", str(tmp_path / "v0"), store, "-q"], check=True)
    dest = str(tmp_path / "dest")
    for i in range(1, 7):
        tensors = _next(tensors, rng)
        src = tmp_path / f"v{i}"
        _big_checkpoint(src, rng, tensors)
        for cmd in (["push", str(src), store, "-q"], ["pull", store, dest, "-q"]):
            proc = subprocess.Popen([sys.executable, "-m", "deltafs.cli.main", *cmd])
            time.sleep(pick.uniform(0.15, 0.6))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            assert verify(store, version=Repository.open(store).head().version).ok
            state = local_version(dest)
            if state is not None:
                assert verify(store, local=dest).ok
    pull(store, dest)
    assert verify(store, all_versions=True).ok and verify(store, local=dest).ok
