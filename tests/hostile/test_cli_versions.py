"""10.1: version numbers outside 0..MAX_VERSION are refused on write, before the store is touched."""

from __future__ import annotations

import os

import pytest

from deltafs.errors import UsageError
from deltafs.format.versions import MAX_VERSION
from deltafs.maintenance.log import log
from deltafs.publish import push

from .conftest import deltafs, one_line


@pytest.mark.parametrize("bad", ["-1", "1733011200000", str(MAX_VERSION + 1)])
def test_push_refuses_a_version_outside_the_range(tmp_path, maker, bad):
    store = tmp_path / "store"
    one_line(deltafs("push", maker.write(), store, "--version", bad), 2, "--version", str(MAX_VERSION))
    assert not os.path.exists(store)  # nothing written, not even the store config


def test_api_push_refuses_a_big_version_and_keeps_history_listable(tmp_path, maker):
    store = str(tmp_path / "store")
    push(store, maker.write(), version=MAX_VERSION - 1)
    with pytest.raises(UsageError):
        push(store, maker.write("b"), version=10 ** 12)
    maker.advance()
    push(store, maker.write("c"))  # HEAD + 1 is the largest valid version
    assert [e.version for e in log(store)] == [MAX_VERSION - 1, MAX_VERSION]
    maker.advance()
    with pytest.raises(UsageError, match="outside"):
        push(store, maker.write("d"))  # HEAD + 1 would need 11 digits


def test_program_version_is_capital_v_and_lowercase_v_is_nothing(tmp_path, maker):
    from deltafs import __version__

    for flag in ("-V", "--version"):
        proc = deltafs(flag, check=0)
        assert proc.stdout.strip() == f"deltafs {__version__}"
    proc = deltafs("push", maker.write(), tmp_path / "store", "-v", "3")
    assert proc.returncode == 2 and "-v" in proc.stderr
    assert not os.path.exists(tmp_path / "store")
    assert "default: the newest" not in deltafs("push", "--help", check=0).stdout


@pytest.mark.parametrize("args", [("1", str(MAX_VERSION + 1)), ("1", "--", "-1"), (str(MAX_VERSION + 1), "1")])
def test_diff_and_show_refuse_a_version_outside_the_range_as_bad_arguments(tmp_path, maker, args):
    """`diff STORE 1 10000000000` was exit 5 ("malformed manifest"), where show, verify and pull say 2."""
    from deltafs.maintenance.inspect import diff
    from deltafs.read.inspect import open_version

    store = str(tmp_path / "store")
    push(store, maker.write())
    one_line(deltafs("diff", store, *args), 2, "is outside", str(MAX_VERSION))
    with pytest.raises(UsageError):
        diff(store, 1, MAX_VERSION + 1)
    with pytest.raises(UsageError):
        open_version(store, -1)


def test_numpy_integers_are_version_numbers_as_their_values(tmp_path, maker):
    """check_version refused numpy's integers (and the diff/show checks added later would have too): they are taken
    as their values, and a push records a plain int."""
    import numpy as np

    from deltafs.maintenance.inspect import diff
    from deltafs.read.inspect import open_version
    from deltafs.read.pull import pull

    store = str(tmp_path / "store")
    assert push(store, maker.write(), version=np.int64(4)).version == 4
    maker.advance()
    push(store, maker.write("b"), version=np.int32(5))
    assert open_version(store, np.int64(4)).manifest.version == 4
    assert [r.name for r in diff(store, np.int64(4), np.uint8(5))]
    assert pull(store, str(tmp_path / "dest"), version=np.int64(4)).version == 4
    with pytest.raises(UsageError, match="must be an integer"):
        push(store, maker.write("c"), version=6.0)
    import torch

    for boolean in (np.bool_(True), torch.tensor(True)):
        with pytest.raises(UsageError, match="must be an integer"):
            push(store, maker.write("c"), version=boolean)
