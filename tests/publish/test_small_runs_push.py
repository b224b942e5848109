"""Runs of small chunks (one task and one pack each) push bit-exact versions whatever the layout moves under them,
with a linked and with a patched push cache, and leave the cache holding the version just pushed."""

from __future__ import annotations

import os

import numpy as np
import pytest

from deltafs.maintenance.verify import verify
from deltafs.publish import push
from deltafs.read.pull import pull
from deltafs.testing.checkpoints import write_safetensors


def _write(path, tensors: dict[str, np.ndarray]) -> str:
    os.makedirs(path, exist_ok=True)
    write_safetensors(os.path.join(path, "model.safetensors"),
                      {n: ("F32", t.shape, t.tobytes()) for n, t in tensors.items()})
    return str(path)


def _step(tensors: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Most elements move by a few ulps; a tenth of the tensors do not change at all."""
    out = {}
    for k, (name, x) in enumerate(tensors.items()):
        moved = (x * (1 + 1e-6 * rng.standard_normal(x.size))).astype(np.float32)
        out[name] = x.copy() if k % 10 == 0 else np.where(rng.random(x.size) < 0.05, x, moved)
    return out


@pytest.mark.parametrize("link", ["auto", "copy"])  # copy: the push cache is patched in place
def test_small_tensor_runs_push_bit_exact_versions_as_the_layout_moves(tmp_path, link):
    rng = np.random.default_rng(2)
    names = [f"layers.{i}.norm" for i in range(120)]
    v1 = {n: rng.standard_normal(int(rng.integers(64, 3000))).astype(np.float32) for n in names}
    store, cache, dest = str(tmp_path / "store"), str(tmp_path / "cache"), str(tmp_path / "dest")
    versions = [v1]
    # v2: the same tensors stepped, in another order: each run's bases lie elsewhere in the cached version.
    v2 = _step(v1, rng)
    versions.append({n: v2[n] for n in names[60:] + names[:60]})
    versions.append(_step(versions[-1], rng))  # v3: the layout of v2
    for k, tensors in enumerate(versions, 1):
        src = _write(tmp_path / f"v{k}", tensors)
        res = push(store, src, cache_dir=cache, link=link)
        assert res.version == k
        assert res.kind == ("full" if k == 1 else "delta") and not res.base_rederived
        pulled = pull(store, dest)
        assert open(os.path.join(pulled.path, "model.safetensors"), "rb").read() == \
            open(os.path.join(src, "model.safetensors"), "rb").read()
    assert verify(store, local=dest).ok
    # The push cache holds v3 exactly (its base check passes, nothing rebuilt from the store): one more push of the
    # same bytes stores no chunk.
    again = push(store, str(tmp_path / "v3"), cache_dir=cache, link=link)
    assert again.chunks_written == 0 and not again.base_rederived
