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
