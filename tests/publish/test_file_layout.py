"""Files that cannot coexist in one directory tree ("a" and "a/b") are refused before anything is written, or,
for a file inherited from the previous version, left behind: a push committed such versions (no reader could
pull them) or failed with a raw IsADirectoryError naming its staging folder (adversarial pass)."""

from __future__ import annotations

import os

import pytest
import torch

from deltafs.errors import UsageError
from deltafs.format.manifest import path_clash
from deltafs.publish import push_tensors
from deltafs.publish.distributed import _layout, _Owned
from deltafs.read.pull import pull


def test_path_clash_names_the_file_that_is_also_a_directory():
    assert path_clash(["a/b", "c", "a"]) == ("a", "a/b")
    assert path_clash(["a/b/c", "a/b"]) == ("a/b", "a/b/c")
    assert path_clash(["ab", "a/b", "a.b"]) is None


@pytest.mark.parametrize("first, second", [("foo", "foo/bar"), ("foo/bar", "foo")])
def test_a_file_replaced_by_a_directory_of_its_name_is_not_inherited(tmp_path, first, second):
    store, cache, dest = str(tmp_path / "store"), str(tmp_path / "cache"), str(tmp_path / "dest")
    w = {"w": torch.arange(8, dtype=torch.float32)}
    push_tensors(store, w, extra_files={first: b"old"}, cache_dir=cache)
    push_tensors(store, w, extra_files={second: b"new"}, cache_dir=cache)
    pull(store, dest)
    assert open(os.path.join(dest, second), "rb").read() == b"new"
    assert not os.path.isfile(os.path.join(dest, first)) or first == second


def test_an_extra_file_inside_a_shard_name_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="model.safetensors would be both a file and the directory of "
                                         "model.safetensors/x"):
        push_tensors(str(tmp_path / "store"), {"w": torch.zeros(2)}, extra_files={"model.safetensors/x": b"1"})
    assert not (tmp_path / "store").exists()


def test_ranks_whose_files_cannot_coexist_are_refused_on_every_rank():
    owned = [_Owned([("a", "F32", (2,), 8)], {"config.json": ("s1", 1)}),
             _Owned([("b", "F32", (2,), 8)], {"config.json/x": ("s2", 1)})]
    with pytest.raises(UsageError, match="config.json would be both a file and the directory of config.json/x"):
        _layout(owned, 2)
