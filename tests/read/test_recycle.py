"""An update pull writes into the files of the version it would otherwise delete, and never into anything else."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from deltafs.maintenance.verify import verify
from deltafs.read.dest import LocalCheckpoint
from deltafs.read.pull import local_version, pull
from deltafs.store.repo import Repository
from deltafs.testing.checkpoints import CheckpointMaker, files_of

from history_helpers import push_history
from tests.read.test_crash import DRIVER


def _versions(tmp_path, n: int, **kw):
    """n versions pushed to a store; their source directories in order."""
    store = str(tmp_path / "store")
    Repository.open(store, create=True, chunk_bytes=kw.pop("chunk_bytes", 4 << 10))
    history = push_history(store, CheckpointMaker(str(tmp_path / "src"), seed=7, **kw), n)
    return store, [history[v] for v in sorted(history)]


def _at_version_2(tmp_path, n: int = 3, **kw):
    """A store of n versions and a DEST that pulled 1 then 2: (store, sources, dest, v1 dir, v2 dir)."""
    store, src = _versions(tmp_path, n, **kw)
    dest = str(tmp_path / "dest")
    pull(store, dest, version=1)
    v1 = local_version(dest).path
    pull(store, dest, version=2)
    return store, src, dest, v1, local_version(dest).path


def _make_oldest(version_dir: str) -> None:
    """Editing a version directory makes it the newest by mtime, which cleanup and recycling go by: undo that."""
    os.utime(version_dir, (1_000_000_000, 1_000_000_000))


def _inodes(version_dir: str) -> dict[str, int]:
    out = {}
    for top, _dirs, files in os.walk(version_dir):
        for name in files:
            full = os.path.join(top, name)
            out[os.path.relpath(full, version_dir)] = os.lstat(full).st_ino
    return out


def test_pull_rewrites_the_version_it_would_delete(tmp_path):
    store, src, dest, v1, v2 = _at_version_2(tmp_path)
    before = _inodes(v1)
    v2_files = files_of(dest)
    res = pull(store, dest, version=3, keep=2)
    assert files_of(dest) == files_of(src[2])
    assert not os.path.exists(v1)  # it became version 3
    assert sorted(os.listdir(dest + ".deltafs")) == sorted(
        [os.path.basename(v2), os.path.basename(v2) + ".json", os.path.basename(res.path),
         os.path.basename(res.path) + ".json", "lock"])
    after = _inodes(res.path)
    # The weights file of version 1 (one link, changed in every version) now holds version 3.
    assert after["model.safetensors"] == before["model.safetensors"]
    # Version 2 is untouched, including the files it shares with version 1 by hard link (config.json).
    assert os.stat(os.path.join(v2, "config.json")).st_nlink >= 1
    assert files_of(v2) == v2_files
    assert verify(store, local=dest).ok


@pytest.mark.parametrize("recycle", [True, False])
def test_a_reader_of_the_oldest_version_sees_what_recycle_says(tmp_path, recycle):
    """With recycle, an open file of the version that falls out of `keep` changes under its reader; without, the
    reader keeps the old bytes (the file is deleted, not rewritten)."""
    store, src, dest, v1, _v2 = _at_version_2(tmp_path)
    v1_weights = files_of(v1)["model.safetensors"]
    fd = os.open(os.path.join(v1, "model.safetensors"), os.O_RDONLY)
    try:
        pull(store, dest, version=3, recycle=recycle)
        data = os.pread(fd, 1 << 20, 0)
    finally:
        os.close(fd)
    assert files_of(dest) == files_of(src[2])
    assert data == (files_of(src[2])["model.safetensors"] if recycle else v1_weights)
    assert len(LocalCheckpoint(dest).version_dirs()) == 2


def test_the_current_version_is_never_rewritten(tmp_path):
    """keep=1 removes the previous version after the install; it is also the delta's base, so it is not reused."""
    store, src = _versions(tmp_path, 3)
    dest = str(tmp_path / "dest")
    pull(store, dest, version=1, keep=1)
    pull(store, dest, version=2, keep=1)
    v2 = local_version(dest).path
    v2_files = files_of(v2)
    ino = _inodes(v2)
    fd = os.open(os.path.join(v2, "model.safetensors"), os.O_RDONLY)  # an engine still reading it
    try:
        pull(store, dest, version=3, keep=1)
        assert files_of(dest) == files_of(src[2])
        assert os.fstat(fd).st_ino == ino["model.safetensors"]
        data = os.pread(fd, 1 << 20, 0)
    finally:
        os.close(fd)
    assert data == v2_files["model.safetensors"]  # the open file kept version 2's bytes
    assert len(LocalCheckpoint(dest).version_dirs()) == 1


def test_planted_links_and_extra_files_in_the_old_version_are_not_followed(tmp_path):
    store, src, dest, v1, _v2 = _at_version_2(tmp_path, shards=2)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"do not touch")
    victim_dir = tmp_path / "victim-dir"
    victim_dir.mkdir()
    # Every file of version 1 replaced by a symlink out of it, its subdirectory too, plus a stray file.
    for name in os.listdir(v1):
        full = os.path.join(v1, name)
        if os.path.isfile(full) and not os.path.islink(full):
            os.unlink(full)
            os.symlink(outside, full)
    os.rename(os.path.join(v1, "tokenizer"), os.path.join(v1, "tokenizer-real"))
    os.symlink(victim_dir, os.path.join(v1, "tokenizer"))
    with open(os.path.join(v1, "stray.txt"), "w") as fh:
        fh.write("left by someone")
    _make_oldest(v1)
    res = pull(store, dest, version=3)
    assert files_of(dest) == files_of(src[2])
    assert outside.read_bytes() == b"do not touch"
    assert os.listdir(victim_dir) == []
    assert not os.path.exists(os.path.join(res.path, "stray.txt"))
    assert not os.path.exists(os.path.join(res.path, "tokenizer-real"))
    assert verify(store, local=dest).ok


def test_a_file_shared_by_hard_link_with_a_kept_version_is_not_written(tmp_path):
    store, src, dest, v1, v2 = _at_version_2(tmp_path)
    # As if a tool had deduplicated the two versions: version 1's weights are a hard link of version 2's.
    os.unlink(os.path.join(v1, "model.safetensors"))
    os.link(os.path.join(v2, "model.safetensors"), os.path.join(v1, "model.safetensors"))
    _make_oldest(v1)
    v2_files = files_of(v2)
    pull(store, dest, version=3)
    assert files_of(dest) == files_of(src[2])
    assert files_of(v2) == v2_files


def test_old_version_sizes_differ(tmp_path):
    """The recycled files are longer or shorter than the new ones: truncated or extended to the exact size."""
    store, src, dest, v1, _v2 = _at_version_2(tmp_path, 2)
    with open(os.path.join(v1, "model.safetensors"), "ab") as fh:
        fh.write(b"\xff" * 100_000)  # longer than any new file
    with open(os.path.join(v1, "tokenizer", "tokenizer.json"), "r+b") as fh:  # its own file (changes every step)
        fh.truncate(3)
    _make_oldest(v1)
    maker = CheckpointMaker(str(tmp_path / "src3"), seed=8)
    third = maker.write()
    from deltafs.publish import push

    push(store, third)
    pull(store, dest)
    assert files_of(dest) == files_of(third)
    assert verify(store, local=dest).ok


@pytest.mark.parametrize("count", [0, 3])
def test_pull_killed_while_rewriting_an_old_version(tmp_path, count):
    store, src, dest, _v1, v2 = _at_version_2(tmp_path)
    proc = subprocess.run([sys.executable, "-c", DRIVER, "fetch", str(count), "pull", store, dest, "-q"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    state = local_version(dest)
    assert state.version == 2 and state.path == v2  # DEST never pointed at the half-written directory
    assert files_of(dest) == files_of(src[1])
    assert verify(store, local=dest).ok
    res = pull(store, dest)
    assert res.version == 3 and files_of(dest) == files_of(src[2])
    assert not [n for n in os.listdir(dest + ".deltafs") if n.startswith("staging-")]


def test_keep_follows_pull_order_when_every_file_is_rewritten_in_place(tmp_path):
    """A recycled directory keeps its old mtime unless the install refreshes it: cleanup (which goes by mtime)
    would then take the newest version for the oldest and delete the previous one instead."""
    from deltafs.publish import push
    from deltafs.testing.checkpoints import random_bytes, write_safetensors

    store, dest = str(tmp_path / "store"), str(tmp_path / "dest")
    Repository.open(store, create=True, chunk_bytes=4 << 10)
    rng = np.random.default_rng(11)
    paths = {}
    for v in range(1, 6):  # one file, every byte new: nothing is hard-linked, nothing pruned
        src = tmp_path / f"src{v}"
        write_safetensors(str(src / "model.safetensors"), {"w": ("F32", (64, 64), random_bytes(rng, 64 * 64 * 4))})
        push(store, str(src))
        pull(store, dest, keep=2)
        paths[v] = local_version(dest).path
        kept = {os.path.basename(p) for p in LocalCheckpoint(dest).version_dirs()}
        assert kept == {os.path.basename(paths[v])} | ({os.path.basename(paths[v - 1])} if v > 1 else set()), v
        assert files_of(dest) == files_of(src)


def test_a_killed_pulls_staging_directory_is_removed_before_anything_else(tmp_path):
    """A pull killed while it rewrote the oldest version leaves that version as a staging directory. The next pull
    removes it first, also when DEST is already current (on a disk sized for two versions, its space is what the
    next version needs)."""
    store, src, dest, _v1, v2 = _at_version_2(tmp_path)
    proc = subprocess.run([sys.executable, "-c", DRIVER, "fetch", "3", "pull", store, dest, "-q"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    sidecar = dest + ".deltafs"
    assert [n for n in os.listdir(sidecar) if n.startswith("staging-")]
    res = pull(store, dest, version=2)  # already current: nothing to build, the leftover goes all the same
    assert not res.updated and local_version(dest).path == v2
    assert not [n for n in os.listdir(sidecar) if n.startswith("staging-")]
    assert files_of(dest) == files_of(src[1]) and verify(store, local=dest).ok


@pytest.mark.parametrize("recycle", [True, False])
def test_the_version_dest_pointed_to_is_kept_whatever_the_mtimes(tmp_path, recycle):
    """Cleanup keeps the newest versions by mtime; an older directory touched since (a backup tool, a watcher
    protecting what its engine served) must not push out the version DEST pointed to before the pull, which an
    engine may still be reading."""
    store, src, dest, v1, v2 = _at_version_2(tmp_path)
    future = os.stat(v2).st_mtime + 3600
    os.utime(v1, (future, future))
    pull(store, dest, version=3, recycle=recycle)
    assert files_of(dest) == files_of(src[2])
    assert os.path.isdir(v2) and files_of(v2) == files_of(src[1])


@pytest.mark.parametrize("verify_files", [False, True])
def test_an_extra_file_in_dest_is_found_and_the_version_rebuilt_without_it(tmp_path, verify_files):
    """A file planted in the version DEST points to (an extra .safetensors an engine would glob, a link) is not
    part of the version: pull repairs DEST as for an edited file, and verify --local reports it meanwhile."""
    store, src, dest, _v1, _v2 = _at_version_2(tmp_path)
    with open(os.path.join(dest, "evil.safetensors"), "wb") as fh:
        fh.write(b"\0" * 64)
    os.symlink("/etc/passwd", os.path.join(dest, "link.json"))
    report = verify(store, local=dest)
    assert not report.ok and any("evil.safetensors is not part of version 2" in p for p in report.problems)
    assert any("link.json is not part of version 2" in p for p in report.problems)
    res = pull(store, dest, version=2, verify_files=verify_files)
    assert res.updated and res.repaired == "evil.safetensors is not part of version 2"
    assert files_of(dest) == files_of(src[1]) and sorted(os.listdir(dest)) == sorted(os.listdir(src[1]))
    assert verify(store, local=dest).ok


def test_no_version_is_recycled_while_an_engine_switch_holds_the_engine_lock(tmp_path):
    """A manual pull during a watcher's switch recycled the directory the engine was loading (the watcher's target
    had fallen out of the kept ones): the engine read changed bytes and the watcher called the version live."""
    store, src, dest, v1, v2 = _at_version_2(tmp_path, 4)
    name = max(os.listdir(v1), key=lambda n: os.path.getsize(os.path.join(v1, n)))
    with open(os.path.join(v1, name), "rb") as loading:  # the engine has the file open, as a load does
        before = loading.read()
        with LocalCheckpoint(dest).lock(wait=False, name="engine.lock"):  # ... while its switch holds the lock
            pull(store, dest, version=3, keep=2)
        loading.seek(0)
        assert loading.read() == before  # the bytes it reads were never rewritten in place
    assert files_of(dest) == files_of(src[2])
    pull(store, dest, version=4, keep=2)  # no switch: recycling as before
    assert files_of(dest) == files_of(src[3])


def test_the_version_a_switch_record_names_is_neither_removed_nor_recycled(tmp_path, maker):
    """A cron `pull --engine` loading version 3 while the watcher pulled 4, 5 and 6: the watcher's cleanup (keep 3:
    the newest two and what it serves) removed version 3's directory mid-load, and the engine failed reading
    config.json (adversarial pass). The version DEST.deltafs/engine-switch.json names stays, and is not recycled."""
    import json
    import os

    from deltafs.publish import push
    from deltafs.read.dest import SWITCH_RECORD, LocalCheckpoint
    from deltafs.read.pull import pull

    store, dest = str(tmp_path / "store"), str(tmp_path / "dest")
    loading = None
    for step in range(6):
        push(store, maker.write())
        maker.advance()
        res = pull(store, dest, keep=3)
        if step == 2:
            loading = res.path
            with open(os.path.join(dest + ".deltafs", SWITCH_RECORD), "w") as fh:
                json.dump({"version": "3", "path": loading, "pid": 1, "deadline": 0}, fh)
            before = {f: os.stat(os.path.join(loading, f)).st_ino for f in os.listdir(loading)}
    assert loading is not None and os.path.isdir(loading)
    assert {f: os.stat(os.path.join(loading, f)).st_ino for f in os.listdir(loading)} == before  # not rewritten
    assert LocalCheckpoint(dest).switch_target() == os.path.basename(loading)
