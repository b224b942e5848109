"""10.2: paths deltafs writes beside DEST are never followed through a planted symlink, and cleanup
removes only what deltafs provably made."""

from __future__ import annotations

import os

from deltafs.read.pull import pull

from .conftest import deltafs, one_line


def _victim(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "vital").mkdir()  # the old cleanup removed every directory starting with "v"
    (victim / "keep.txt").write_text("mine")
    return victim


def test_planted_sidecar_symlink_is_refused(tmp_path, store):
    victim = _victim(tmp_path)
    os.symlink(victim, tmp_path / "dest.deltafs")
    one_line(deltafs("pull", store, tmp_path / "dest"), 9, "dest.deltafs", "symlink")
    assert sorted(os.listdir(victim)) == ["keep.txt", "vital"]
    assert not os.path.lexists(tmp_path / "dest")


def test_planted_lock_and_chunk_cache_symlinks_are_refused(tmp_path, store):
    victim = _victim(tmp_path)
    sidecar = tmp_path / "dest.deltafs"
    sidecar.mkdir()
    os.symlink(victim / "keep.txt", sidecar / "lock")
    one_line(deltafs("pull", store, tmp_path / "dest"), 9, "lock", "symlink")
    assert (victim / "keep.txt").read_text() == "mine"
    os.unlink(sidecar / "lock")
    os.symlink(victim, sidecar / "chunks")
    one_line(deltafs("pull", store, tmp_path / "dest"), 9, "chunks", "symlink")
    assert sorted(os.listdir(victim)) == ["keep.txt", "vital"]


def test_sidecar_of_another_user_or_world_writable_is_refused(tmp_path, store):
    sidecar = tmp_path / "dest.deltafs"
    sidecar.mkdir()
    os.chmod(sidecar, 0o777)
    one_line(deltafs("pull", store, tmp_path / "dest"), 9, "writable by everyone")
    assert os.listdir(sidecar) == []


def test_cleanup_removes_only_what_deltafs_made(tmp_path, store, maker):
    dest = str(tmp_path / "dest")
    pull(store, dest)
    sidecar = tmp_path / "dest.deltafs"
    victim = _victim(tmp_path)
    os.symlink(victim, sidecar / "v0000000001-deadbeef")  # a version-looking symlink
    (sidecar / "v0000000001-cafebabe").mkdir()  # a version-looking directory without deltafs's state file
    (sidecar / "very-important").mkdir()
    (sidecar / "staging-notours").mkdir()
    from deltafs.publish import push

    for _ in range(3):  # more versions than `keep`: cleanup runs and removes old versions
        maker.advance()
        push(store, maker.write())
        pull(store, dest)
    left = set(os.listdir(sidecar))
    assert {"v0000000001-deadbeef", "v0000000001-cafebabe", "very-important", "staging-notours"} <= left
    assert sorted(os.listdir(victim)) == ["keep.txt", "vital"]
    assert len([n for n in left if n.endswith(".json")]) == 2  # keep=2 versions with their states
