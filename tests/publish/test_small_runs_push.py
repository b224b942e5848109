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


def _write_shards(path, shards: list[dict[str, np.ndarray]]) -> str:
    os.makedirs(path, exist_ok=True)
    for k, tensors in enumerate(shards):
        write_safetensors(os.path.join(path, f"model-{k:05d}-of-{len(shards):05d}.safetensors"),
                          {n: ("F32", t.shape, t.tobytes()) for n, t in tensors.items()})
    return str(path)


def _files(path) -> dict[str, bytes]:
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path))}


def test_a_run_whose_bases_lie_in_two_cached_shards_pushes_bit_exact(tmp_path):
    """Tensors move between shards: one run of the new shard has bases in both files of the cached version."""
    rng = np.random.default_rng(3)
    names = [f"layers.{i}.bias" for i in range(40)]
    v1 = {n: rng.standard_normal(int(rng.integers(64, 700))).astype(np.float32) for n in names}
    store, cache, dest = str(tmp_path / "store"), str(tmp_path / "cache"), str(tmp_path / "dest")
    src1 = _write_shards(tmp_path / "v1", [{n: v1[n] for n in names[:20]}, {n: v1[n] for n in names[20:]}])
    push(store, src1, cache_dir=cache)
    v2 = _step(v1, rng)
    # The first shard interleaves tensors that were in shard 0 and in shard 1.
    mixed = [n for pair in zip(names[:10], names[20:30], strict=True) for n in pair]
    rest = [n for n in names if n not in mixed]
    src2 = _write_shards(tmp_path / "v2", [{n: v2[n] for n in mixed}, {n: v2[n] for n in rest}])
    res = push(store, src2, cache_dir=cache)
    assert res.kind == "delta" and not res.base_rederived and res.chunks_written > 0
    pulled = pull(store, dest)
    assert _files(pulled.path) == _files(src2)
    again = push(store, src2, cache_dir=cache)
    assert again.chunks_written == 0 and not again.base_rederived


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_cache_under_a_run_is_rebuilt_from_the_store(tmp_path, damage):
    """The bytes a run reads as its bases are checked like single chunks': a cut-short or altered cache file makes the
    push rebuild its base from the store, and the version it writes is still exact."""
    rng = np.random.default_rng(4)
    names = [f"layers.{i}.norm" for i in range(30)]
    v1 = {n: rng.standard_normal(int(rng.integers(64, 900))).astype(np.float32) for n in names}
    store, cache, dest = str(tmp_path / "store"), str(tmp_path / "cache"), str(tmp_path / "dest")
    push(store, _write(tmp_path / "v1", v1), cache_dir=cache, link="copy")
    cached = [os.path.join(root, "model.safetensors") for root, _dirs, files in os.walk(cache)
              if "model.safetensors" in files]
    assert len(cached) == 1
    size = os.path.getsize(cached[0])
    with open(cached[0], "r+b") as fh:
        if damage == "truncate":
            fh.truncate(size - 1000)
        else:
            fh.seek(size - 1000)
            fh.write(b"\x5a" * 4)
    src = _write(tmp_path / "v2", _step(v1, rng))
    res = push(store, src, cache_dir=cache, link="copy")
    assert res.kind == "delta" and res.base_rederived
    pulled = pull(store, dest)
    assert open(os.path.join(pulled.path, "model.safetensors"), "rb").read() == \
        open(os.path.join(src, "model.safetensors"), "rb").read()
    assert verify(store, local=dest).ok
