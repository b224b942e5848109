"""A push stores the same objects, and a pull rebuilds the same bytes, whether the codec's compiled loops run or not
(DELTAFS_NATIVE=0): the compiled compare, sparse streams and apply are the numpy code's, byte for byte, end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deltafs.codec import native
from deltafs.testing.trained import TrainedRun, config_for, parse_count, write_version


def _cli(*args: str, native_on: bool) -> None:
    env = {**os.environ, "DELTAFS_NATIVE": "1" if native_on else "0", "DELTAFS_ALLOW_NO_NATIVE": "1"}
    done = subprocess.run([sys.executable, "-m", "deltafs.cli.main", *args], env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr


def _objects(store: Path) -> set[str]:
    return {p.name for p in (store / "chunks").rglob("*") if p.is_file()}


@pytest.mark.skipif(not native.BUILT, reason="deltafs.codec._native was not built (no C compiler)")
def test_compiled_and_numpy_pushes_store_the_same_objects(tmp_path: Path) -> None:
    """A trained step (bf16 matrices at ~1.6% changed, F32 norms and biases nearly all changed, a header): both
    paths write the same chunk objects, and a numpy-path pull of the compiled path's store gives the checkpoint."""
    cfg = config_for(parse_count("2M"))
    run = TrainedRun(cfg, seed=3, lr=1e-6)
    write_version(tmp_path / "v1", run.export(), cfg, step=1)
    write_version(tmp_path / "v2", run.step(), cfg, step=2)
    for on in (True, False):
        store = tmp_path / f"store-{int(on)}"
        for version in ("v1", "v2"):
            _cli("push", str(tmp_path / version), str(store), native_on=on)
    compiled, numpy_path = _objects(tmp_path / "store-1"), _objects(tmp_path / "store-0")
    assert len(compiled) >= 5 and compiled == numpy_path
    _cli("pull", str(tmp_path / "store-1"), str(tmp_path / "dest"), native_on=False)
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "dest" / name).read_bytes() == (tmp_path / "v2" / name).read_bytes()
