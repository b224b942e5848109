"""10.10: a full disk leaves no temporary files, names the path, and `--no-chunk-cache` pulls in less space.

Each test mounts a small tmpfs (root only; skipped where mount is refused).
"""

from __future__ import annotations

import contextlib
import os
import subprocess

import numpy as np
import pytest

from deltafs.publish import push
from deltafs.testing.checkpoints import files_of, random_bytes, write_safetensors

from .conftest import deltafs, one_line

MiB = 1 << 20


@pytest.fixture
def small_disk(tmp_path):
    mounted = []

    def mount(size: int) -> str:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        path = tmp_path / f"disk{len(mounted)}"
        path.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
        if proc.returncode != 0:
            pytest.skip(f"mount refused: {proc.stderr.decode().strip()}")
        mounted.append(path)
        return str(path)

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _checkpoint(path, mib: int) -> str:
    """An incompressible checkpoint of about `mib` MiB (stored chunks are as large as the files)."""
    rng = np.random.default_rng(0)
    n = mib * MiB // 4
    write_safetensors(os.path.join(path, "model.safetensors"), {"w": ("F32", (n,), random_bytes(rng, n * 4))})
    with open(os.path.join(path, "config.json"), "w") as fh:
        fh.write("{}\n")
    return str(path)


def _leftovers(root: str) -> list[str]:
    return [os.path.join(d, n) for d, dirs, files in os.walk(root) for n in files + dirs
            if n.startswith((".tmp-", "staging-", ".dest.tmp-"))]


def test_push_to_a_full_local_store_leaves_no_temp_files(tmp_path, small_disk):
    disk = small_disk(3 * MiB)
    src = _checkpoint(tmp_path / "src", 6)
    store = os.path.join(disk, "store")
    for _ in range(3):  # every failed push used to leave its partial chunk behind
        proc = deltafs("push", src, store)
        assert proc.returncode != 0 and "No space left" in proc.stderr and store in proc.stderr, proc.stderr
    assert _leftovers(disk) == []


def test_pull_onto_a_full_disk_names_the_path_and_cleans_up(tmp_path, small_disk):
    src = _checkpoint(tmp_path / "src", 6)
    store = str(tmp_path / "store")
    push(store, src)
    disk = small_disk(3 * MiB)
    dest = os.path.join(disk, "dest")
    one_line(deltafs("pull", store, dest), 12, "No space left", disk)
    assert not os.path.lexists(dest)
    assert _leftovers(disk) == [] and not os.path.exists(os.path.join(disk, "dest.deltafs", "chunks"))


def test_no_chunk_cache_pulls_where_the_cache_does_not_fit(tmp_path, small_disk, s3_url, s3_options):
    """From a remote store (moto S3 here) fetched chunks are kept beside DEST unless --no-chunk-cache."""
    import json

    src = _checkpoint(tmp_path / "src", 6)
    push(s3_url, src, storage_options=s3_options)
    opts = json.dumps(s3_options)
    disk = small_disk(9 * MiB)  # the checkpoint fits, the checkpoint plus its fetched chunks does not
    dest = os.path.join(disk, "dest")
    one_line(deltafs("pull", s3_url, dest, "--storage-options", opts), 12, "No space left", "--no-chunk-cache")
    assert _leftovers(disk) == []
    deltafs("pull", s3_url, dest, "--no-chunk-cache", "--storage-options", opts, check=0)
    assert files_of(dest) == files_of(src)


def _at_version_2_on_a_disk_for_two(tmp_path, small_disk, seed: int):
    """Three versions of 6 MiB, every byte new each version (nothing shared by hard link), and a DEST on a disk
    that holds two of them, at version 2 after pulling 1 and 2: (store, sources, disk, dest)."""
    store = str(tmp_path / "store")
    rng = np.random.default_rng(seed)
    sources = []
    for v in range(3):
        src = tmp_path / f"src{v}"
        n = 6 * MiB // 4
        write_safetensors(str(src / "model.safetensors"), {"w": ("F32", (n,), random_bytes(rng, n * 4))})
        push(store, str(src))
        sources.append(src)
    disk = small_disk(13 * MiB + MiB // 2)
    dest = os.path.join(disk, "dest")
    deltafs("pull", store, dest, "--version", "1", check=0)
    deltafs("pull", store, dest, "--version", "2", check=0)
    return store, sources, disk, dest


def test_recycling_pulls_into_the_space_of_the_version_it_replaces(tmp_path, small_disk):
    """A disk that holds two versions: the third pull fits by rewriting the oldest one; --no-recycle needs room
    for a third copy first, fails with exit 12, and leaves DEST on its version with nothing half-written."""
    store, sources, disk, dest = _at_version_2_on_a_disk_for_two(tmp_path, small_disk, seed=5)
    one_line(deltafs("pull", store, dest, "--no-recycle"), 12, "No space left", disk)
    assert files_of(dest) == files_of(sources[1]) and _leftovers(disk) == []
    deltafs("pull", store, dest, check=0)
    assert files_of(dest) == files_of(sources[2]) and _leftovers(disk) == []
    assert len([n for n in os.listdir(dest + ".deltafs") if n.startswith("v") and not n.endswith(".json")]) == 2


def test_a_pull_killed_while_recycling_does_not_leave_the_disk_too_full_for_the_next(tmp_path, small_disk):
    """The same disk for two versions: a pull killed while it rewrote the oldest version leaves that version as a
    staging directory. The next pull removes it before it writes (it used to be removed only after a successful
    pull, so every retry ran out of space, exit 12, until someone deleted it by hand)."""
    import signal
    import subprocess
    import sys

    from tests.read.test_crash import DRIVER

    store, sources, disk, dest = _at_version_2_on_a_disk_for_two(tmp_path, small_disk, seed=6)
    killed = subprocess.run([sys.executable, "-c", DRIVER, "fetch", "1", "pull", store, dest, "-q"],
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert [n for n in os.listdir(dest + ".deltafs") if n.startswith("staging-")]  # the recycled version, half new
    assert files_of(dest) == files_of(sources[1])
    deltafs("pull", store, dest, check=0)
    assert files_of(dest) == files_of(sources[2]) and _leftovers(disk) == []


def test_a_keyframe_push_that_runs_out_of_space_publishes_all_or_nothing(tmp_path, small_disk):
    """A full version (with its bridge) pushed onto a store disk left with just about its own size free, for a
    range of free space around the edge: wherever ENOSPC strikes (a chunk, the bridge, the manifest, HEAD), a
    push that exits 0 has published version 3 and one that fails has not (no manifest, a one-line "No space
    left" error beside at most a warning), no temporary file is left, the store verifies, and once space is
    freed a host at version 2 pulls the newest version and the next push works. Before, a HEAD that could not
    be written after the manifest was made failed the push (exit 3) though version 3 was published."""
    import json

    rng = np.random.default_rng(7)
    n = 3 * MiB // 4
    v1 = rng.standard_normal(n).astype(np.float32)
    v2 = v1.copy()
    moved = rng.choice(n, n // 50, replace=False)
    v2[moved] += np.float32(1e-4)
    v3 = v2.copy()
    v3[moved[:1000]] += np.float32(1e-4)
    srcs = []
    for i, arr in enumerate((v1, v2, v3), 1):
        src = tmp_path / f"src{i}"
        write_safetensors(str(src / "model.safetensors"), {"w": ("F32", (n,), arr.tobytes())})
        srcs.append(str(src))
    probe = str(tmp_path / "probe")
    deltafs("push", srcs[0], probe, check=0)
    deltafs("push", srcs[1], probe, check=0)
    full = json.loads(deltafs("push", srcs[2], probe, "--full", "--json", check=0).stdout)
    assert full["kind"] == "full" and full["bridge_bytes"] > 0
    pages = -(-full["bytes_written"] // 4096)
    disk = small_disk(8 * MiB)
    outcomes = set()
    for extra in range(-3, 5):
        store, dest = os.path.join(disk, "store"), str(tmp_path / f"dest{extra}")
        deltafs("push", srcs[0], store, check=0)
        deltafs("push", srcs[1], store, check=0)
        deltafs("pull", store, dest, check=0)
        st = os.statvfs(disk)
        free = st.f_bavail * st.f_frsize
        filler = os.path.join(disk, "filler")
        with open(filler, "wb") as fh:
            fh.write(b"\0" * max(0, free - (pages + 4 + extra) * 4096))
        proc = deltafs("push", srcs[2], store, "--full")
        published = os.path.exists(os.path.join(store, "manifests", "v0000000003.json"))
        if proc.returncode == 0:
            assert published and "pushed version 3 (full)" in proc.stdout, (extra, proc.stdout, proc.stderr)
        else:
            errors = [line for line in proc.stderr.splitlines() if "WARNING" not in line]
            assert len(errors) == 1 and "No space left" in errors[0] and store in errors[0], (extra, proc.stderr)
            assert not published, (extra, proc.stderr)
        outcomes.add(proc.returncode == 0)
        assert _leftovers(disk) == [], extra
        os.remove(filler)
        assert deltafs("verify", store, "--all").returncode == 0, extra
        deltafs("pull", store, dest, check=0)
        assert files_of(dest) == files_of(srcs[2] if published else srcs[1]), extra
        deltafs("push", srcs[2], store, check=0)
        deltafs("pull", store, dest, check=0)
        assert files_of(dest) == files_of(srcs[2]), extra
        subprocess.run(["rm", "-rf", store], check=True)
    assert outcomes == {True, False}  # the sweep crossed the edge


def _fill(disk: str) -> str:
    """Fill the filesystem of `disk` to the last byte; returns the filler's path."""
    filler = os.path.join(disk, "filler")
    with open(filler, "wb") as fh:
        with contextlib.suppress(OSError):
            while True:
                fh.write(b"\0" * MiB)
                fh.flush()
    with contextlib.suppress(OSError), open(filler, "ab") as fh:  # the last partial page
        while True:
            fh.write(b"\0" * 512)
            fh.flush()
    return filler


def test_a_full_push_cache_never_fails_a_committed_push_and_names_the_cache(tmp_path, small_disk):
    """The push cache's disk is full (adversarial pass): a delta push whose chunks patched the cache in place
    committed its version, then failed to record the new cache state and exited 12 with a path-less "No space
    left on device" and no JSON, so a trainer retried and published the step twice. The commit stands now: exit 0,
    the result, a warning naming the cache; the next push, which cannot rebuild its base there, fails with one line
    naming the cache and how to move it; with space again the pushes go on and pull the trainer's bytes."""
    import json

    rng = np.random.default_rng(11)
    # Many tensors: the new version's cache record (its manifest, a delta) needs more pages than the old one freed.
    base = {f"layer.{i}.w": rng.standard_normal(2048).astype(np.float32) for i in range(300)}
    srcs = []
    for i in range(3):
        tensors = {}
        for name, arr in base.items():
            arr = arr.copy()
            arr[rng.choice(arr.size, 20, replace=False)] += np.float32(1e-3 * (i + 1))
            tensors[name] = ("F32", (arr.size,), arr.tobytes())
        src = tmp_path / f"src{i}"
        write_safetensors(str(src / "model.safetensors"), tensors)
        srcs.append(str(src))
    store = str(tmp_path / "store")
    disk = small_disk(12 * MiB)
    cache = os.path.join(disk, "cache")
    deltafs("push", srcs[0], store, "--cache", cache, check=0)
    filler = _fill(disk)
    proc = deltafs("push", srcs[1], store, "--cache", cache, "--json")
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert json.loads(proc.stdout)["version"] == 2
    assert "version 2 is committed" in proc.stderr and cache in proc.stderr and "No space left" in proc.stderr
    line = one_line(deltafs("push", srcs[2], store, "--cache", cache), 12, "No space left", cache, "--cache")
    assert line.startswith("deltafs: error: cannot write")
    assert [v["version"] for v in json.loads(deltafs("log", store, "--json", check=0).stdout)["versions"]] == [1, 2]
    os.remove(filler)
    deltafs("push", srcs[2], store, "--cache", cache, check=0)
    dest = str(tmp_path / "dest")
    deltafs("pull", store, dest, check=0)
    assert files_of(dest) == files_of(srcs[2])
    deltafs("verify", store, "--all", check=0)
