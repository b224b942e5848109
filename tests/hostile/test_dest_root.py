"""10.7: `pull STORE /` and a DEST that is someone's directory are refused without side effects."""

from __future__ import annotations

import os

from .conftest import deltafs, one_line


def test_pull_into_the_root_is_refused(tmp_path, store):
    work = tmp_path / "work"
    work.mkdir()
    one_line(deltafs("pull", store, "/", cwd=work), 9, "root")
    assert os.listdir(work) == []  # the old pull wrote .deltafs/ and a dangling temporary link here


def test_existing_foreign_directory_is_refused_without_side_effects(tmp_path, store):
    dest = tmp_path / "models"
    dest.mkdir()
    (dest / "mine.bin").write_bytes(b"x")
    one_line(deltafs("pull", store, dest), 9, "deltafs did not write")
    assert sorted(os.listdir(tmp_path)) == ["models", "push-cache", "src", "store"]
    assert os.listdir(dest) == ["mine.bin"]


def test_a_dest_inside_the_store_or_inside_a_sidecar_is_refused(tmp_path, store):
    """A DEST inside the store it reads would put a foreign key there (gc then stops on it, verify fails); one
    inside another DEST's sidecar would write into verified versions. Both are refused, --force or not, before
    anything is written."""
    before = sorted(os.listdir(os.path.join(store, "manifests")))
    for args in ([], ["--force"]):
        one_line(deltafs("pull", store, os.path.join(store, "manifests", "x"), *args), 9, "inside the store")
        one_line(deltafs("pull", store, os.path.join(store, "copy"), *args), 9, "inside the store")
    assert sorted(os.listdir(os.path.join(store, "manifests"))) == before
    assert not os.path.lexists(os.path.join(store, "copy.deltafs"))
    dest = tmp_path / "d1"
    deltafs("pull", store, dest, check=0)
    version_dir = os.path.realpath(dest)
    for inner in (os.path.join(version_dir, "sub"), os.path.join(str(dest) + ".deltafs", "other")):
        one_line(deltafs("pull", store, inner, "--force"), 9, "where deltafs keeps the versions of")
        assert not os.path.lexists(inner) and not os.path.lexists(inner + ".deltafs")
    assert deltafs("verify", store, "--local", dest).returncode == 0
    assert deltafs("gc", store, "--keep-last", "1").returncode == 0


def test_a_dest_where_no_directory_can_be_made_is_a_local_write_failure(store):
    """(was exit 1, "internal error"): a path under /proc, where mkdir fails, is exit 12 naming the sidecar."""
    if not os.path.isdir("/proc/self"):
        import pytest

        pytest.skip("no /proc")
    one_line(deltafs("pull", store, "/proc/deltafs-dest"), 12, "cannot write /proc/deltafs-dest.deltafs")
