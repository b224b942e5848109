"""10.7: values a careless operator types are refused with exit 2 and one line, before any work."""

from __future__ import annotations

import os

import pytest

from .conftest import deltafs, one_line


def test_level_out_of_range(tmp_path, maker):
    one_line(deltafs("push", maker.write(), tmp_path / "store", "--level", "99"), 2, "--level 99")
    assert not os.path.exists(tmp_path / "store")


@pytest.mark.parametrize("flag", ["--level", "--full-level"])
@pytest.mark.parametrize("value", ["0", "23"])
def test_levels_out_of_range(tmp_path, maker, flag, value):
    one_line(deltafs("push", maker.write(), tmp_path / "store", flag, value), 2, f"{flag} {value}")
    assert not os.path.exists(tmp_path / "store")


def test_threads_at_least_one(tmp_path, store):
    one_line(deltafs("pull", store, tmp_path / "dest", "--threads", "0"), 2, "--threads")
    assert not os.path.lexists(tmp_path / "dest") and not os.path.lexists(tmp_path / "dest.deltafs")


@pytest.mark.parametrize("grace", ["nan", "inf", "-5"])
def test_gc_grace_must_be_finite(store, grace):
    before = sorted(os.listdir(os.path.join(store, "manifests")))
    one_line(deltafs("gc", store, "--keep-last", "1", f"--grace={grace}"), 2, "--grace")
    assert sorted(os.listdir(os.path.join(store, "manifests"))) == before


@pytest.mark.parametrize("poll", ["0", "-1", "nan"])
def test_watch_poll_must_be_positive(tmp_path, store, poll):
    # With a bad --poll the old watcher spun a core forever; now it exits at once.
    one_line(deltafs("watch", store, tmp_path / "dest", f"--poll={poll}", "--once", timeout=60), 2, "--poll")
    assert not os.path.lexists(tmp_path / "dest")
