"""The Python API refuses arguments of the wrong type or range with UsageError (exit 2), before reading or writing
anything, as the CLI does (found by an adversarial pass: threads=0 and keep=-1 were taken, a str version was a
FormatError, a dest of None a TypeError)."""

from __future__ import annotations

import os

import pytest
import torch

from deltafs.errors import UsageError
from deltafs.publish import push, push_tensors
from deltafs.read.pull import pull


@pytest.mark.parametrize("kwargs, message", [
    ({"threads": 0}, "threads must be an integer of at least 1"),
    ({"threads": -1}, "threads must be an integer of at least 1"),
    ({"threads": 1.5}, "threads must be an integer of at least 1"),
    ({"threads": "4"}, "threads must be an integer of at least 1"),
    ({"keep": -1}, "keep must be an integer of at least 0"),
    ({"version": "2"}, "version must be an integer"),
    ({"version": True}, "version must be an integer"),
    ({"version": 2.0}, "version must be an integer"),
    ({"version": -1}, "outside 0..9999999999"),
    ({"version": 10**12}, "outside 0..9999999999"),
    ({"storage_options": "x"}, "storage_options must be a dict"),
])
def test_pull_refuses_bad_arguments_before_anything(tmp_path, maker, kwargs, message):
    store = str(tmp_path / "store")
    push(store, maker.write())
    dest = str(tmp_path / "dest")
    with pytest.raises(UsageError, match=message):
        pull(store, dest, **kwargs)
    assert not os.path.lexists(dest) and not os.path.lexists(dest + ".deltafs")


def test_pull_refuses_a_dest_that_is_not_a_path(tmp_path):
    with pytest.raises(UsageError, match="dest must be a path"):
        pull(str(tmp_path / "store"), None)  # type: ignore[arg-type]


def test_push_tensors_refuses_nothing_to_push_and_the_wrong_container(tmp_path):
    store = str(tmp_path / "store")
    with pytest.raises(UsageError, match="got no tensors"):
        push_tensors(store, {})
    with pytest.raises(UsageError, match="a mapping of names to tensors"):
        push_tensors(store, [torch.zeros(4)])  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="threads must be an integer"):
        push_tensors(store, {"w": torch.zeros(4)}, threads=0)
    assert not os.path.exists(store)


def test_push_tensors_takes_conjugate_views_and_refuses_text_for_extra_files(tmp_path):
    """A lazily conjugated view has no bytes of its own (a RuntimeError before): its values are pushed. A str where
    bytes are expected was a bare TypeError."""
    from safetensors.torch import load_file

    store, dest = str(tmp_path / "store"), str(tmp_path / "dest")
    x = torch.randn(6, dtype=torch.complex64)
    push_tensors(store, {"c": x.conj(), "w": torch.ones(3)})
    pull(store, dest)
    assert torch.equal(load_file(os.path.join(dest, "model.safetensors"))["c"], x.conj().resolve_conj())
    with pytest.raises(UsageError, match="extra file 'config.json' must be bytes, got str"):
        push_tensors(store, {"w": torch.ones(3)}, extra_files={"config.json": "{}"})


def test_a_tensor_named_like_the_metadata_is_refused_by_that_name(tmp_path):
    """safetensors keeps `__metadata__` for the file's metadata: such a tensor was refused as bad metadata."""
    with pytest.raises(UsageError, match="cannot be named __metadata__, the name safetensors keeps"):
        push_tensors(str(tmp_path / "store"), {"__metadata__": torch.zeros(3), "w": torch.ones(2)})
