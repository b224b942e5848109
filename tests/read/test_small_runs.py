"""Small chunks are rebuilt in runs (one base read and one write per run): bit-exact whatever the base's layout,
and a damaged base under a run is caught."""

from __future__ import annotations

import os

import numpy as np
import pytest
from safetensors.numpy import save_file

from deltafs.maintenance.verify import verify
from deltafs.publish import push
from deltafs.read import rebuild
from deltafs.read.pull import pull
from deltafs.testing.checkpoints import write_safetensors


def _tensors(rng: np.random.Generator, names: list[str]) -> dict[str, np.ndarray]:
    return {n: rng.standard_normal(int(rng.integers(64, 3000))).astype(np.float32) for n in names}


def _step(tensors: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One optimizer-sized step: most elements move by a few ulps (dense chunks), about 5% stay."""
    out = {}
    for name, x in tensors.items():
        moved = (x * (1 + 1e-6 * rng.standard_normal(x.size))).astype(np.float32)
        out[name] = np.where(rng.random(x.size) < 0.05, x, moved)
    return out


def _write(path, tensors: dict[str, np.ndarray]) -> None:
    """In this order (safetensors.numpy sorts by name; a trainer's writer need not)."""
    os.makedirs(path, exist_ok=True)
    write_safetensors(os.path.join(path, "model.safetensors"),
                      {n: ("F32", t.shape, t.tobytes()) for n, t in tensors.items()})


def _same(dest, src) -> bool:
    return open(os.path.join(dest, "model.safetensors"), "rb").read() == \
        open(os.path.join(src, "model.safetensors"), "rb").read()


def test_runs_of_small_tensors_pull_bit_exact_when_the_base_layout_moves(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    runs: list[bool] = []
    real = rebuild.Builder._read_local_run

    def spy(self, run, sizes, buf):  # type: ignore[no-untyped-def]
        got = real(self, run, sizes, buf)
        runs.append(got)
        return got

    monkeypatch.setattr(rebuild.Builder, "_read_local_run", spy)
    store, dest = str(tmp_path / "store"), str(tmp_path / "dest")
    names = [f"layers.{i}.norm" for i in range(150)]
    v1 = _tensors(rng, names)
    _write(tmp_path / "v1", v1)
    push(store, str(tmp_path / "v1"), cache_dir=str(tmp_path / "cache"))
    pull(store, dest)
    assert _same(dest, tmp_path / "v1")

    # Same tensors stepped, in another order, one new in the middle and one gone: the base holds the run's
    # chunks elsewhere, so each is read on its own (and the new one has no base at all).
    v2 = _step(v1, rng)
    order = names[75:] + ["layers.new.bias"] + names[1:75]
    v2 = {n: (v2[n] if n in v2 else rng.standard_normal(500).astype(np.float32)) for n in order}
    _write(tmp_path / "v2", v2)
    push(store, str(tmp_path / "v2"), cache_dir=str(tmp_path / "cache"))
    res = pull(store, dest, threads=3)
    assert res.version == 2 and not res.fallback and not res.from_full
    assert _same(dest, tmp_path / "v2")
    assert False in runs

    # The same layout again: whole runs read their base in one pread.
    runs.clear()
    _write(tmp_path / "v3", _step(v2, rng))
    push(store, str(tmp_path / "v3"), cache_dir=str(tmp_path / "cache"))
    res = pull(store, dest, threads=2)
    assert res.version == 3 and not res.fallback
    assert _same(dest, tmp_path / "v3")
    assert runs and all(runs)
    assert verify(store, local=dest).ok


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_base_under_a_run_falls_back_to_the_full_version(tmp_path, damage):
    rng = np.random.default_rng(1)
    v1 = _tensors(rng, [f"t.{i:03d}" for i in range(100)])
    store, dest = str(tmp_path / "store"), str(tmp_path / "dest")
    save_file(v1, str(tmp_path / "model.safetensors"))
    os.makedirs(tmp_path / "v1")
    os.replace(tmp_path / "model.safetensors", tmp_path / "v1" / "model.safetensors")
    push(store, str(tmp_path / "v1"), cache_dir=str(tmp_path / "cache"))
    pull(store, dest)
    os.makedirs(tmp_path / "v2")
    save_file(_step(v1, rng), str(tmp_path / "v2" / "model.safetensors"))
    push(store, str(tmp_path / "v2"), cache_dir=str(tmp_path / "cache"))

    base = os.path.join(dest, "model.safetensors")
    data = bytearray(open(base, "rb").read())
    if damage == "flip":
        data[len(data) // 2] ^= 0x10  # inside the small tensors, which are rebuilt in runs
    else:
        del data[len(data) // 2:]
    os.chmod(base, 0o644)
    open(base, "wb").write(bytes(data))

    res = pull(store, dest)
    assert res.version == 2 and res.fallback and res.from_full
    assert _same(dest, tmp_path / "v2")
