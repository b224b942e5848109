"""open_version reads single tensors without a pull; plan_pull says what a pull would read."""

from __future__ import annotations

import os

import numpy as np
import pytest

from deltafs.errors import IntegrityError, UsageError
from deltafs.publish import push
from deltafs.read import pull
from deltafs.read.inspect import open_version, plan_pull
from deltafs.store.repo import Repository
from history_helpers import push_history


def _history(tmp_path, maker, n=3):
    store = str(tmp_path / "store")
    history = push_history(store, maker, n)
    return store, [history[v] for v in sorted(history)]


def test_tensors_equal_the_pushed_bytes_at_every_version(tmp_path, maker):
    store, _ = _history(tmp_path, maker, n=1)
    first = {n: t for n, t in maker.tensors.items()}  # after advance(): these are version 2's
    push(store, maker.write())
    for version, expected in ((2, first),):
        reader = open_version(store, version)
        assert set(reader.tensor_names()) == set(expected)
        for name, (dtype, shape, data) in expected.items():
            assert reader.tensor_bytes(name) == data, name
            if dtype == "F32":
                arr = reader.tensor(name)
                assert arr.dtype == np.float32 and arr.shape == shape
                assert arr.tobytes() == data


def test_bf16_comes_back_through_torch_and_numpy_refuses_it(tmp_path, maker):
    torch = pytest.importorskip("torch")
    store, _ = _history(tmp_path, maker, n=2)
    reader = open_version(store)  # HEAD
    t = reader.tensor("lm_head.weight", framework="torch")
    assert t.dtype == torch.bfloat16 and tuple(t.shape) == (64, 48)
    assert t.view(torch.uint16).numpy().tobytes() == reader.tensor_bytes("lm_head.weight")
    with pytest.raises(UsageError, match="numpy lacks"):
        reader.tensor("lm_head.weight")
    with pytest.raises(UsageError, match="no tensor"):
        reader.tensor("nope")


def test_a_corrupt_chunk_is_an_integrity_error(tmp_path, maker):
    store, _ = _history(tmp_path, maker, n=2)
    repo = Repository.open(store)
    seg = next(s for f in repo.manifest(1).files for s in f.segments if s.key == "t:lm_head.weight")
    oid = seg.chunks[0].object
    path = os.path.join(store, "chunks", oid[:2], oid)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    os.chmod(path, 0o644)
    open(path, "wb").write(bytes(data))
    with pytest.raises(IntegrityError):
        open_version(store, 2).tensor_bytes("lm_head.weight")


def test_plan_pull_matches_what_the_pull_reads(tmp_path, maker):
    store, _ = _history(tmp_path, maker, n=3)
    dest = str(tmp_path / "dest")
    cold = plan_pull(store, dest)
    assert not cold.up_to_date and cold.current is None and cold.steps[0]["kind"] == "full"
    res = pull(store, dest, version=2)
    assert not os.path.exists(os.path.join(tmp_path, "dest.deltafs", "v0000000003"))
    plan = plan_pull(store, dest)
    assert plan.current == 2 and [s["version"] for s in plan.steps] == [3]
    res = pull(store, dest)
    assert res.bytes_read == plan.bytes_to_read
    assert plan_pull(store, dest).up_to_date
