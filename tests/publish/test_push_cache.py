"""The push cache takes a pushed file without copying it, and survives a trainer that rewrites files in place."""

from __future__ import annotations

import os

import numpy as np

from deltafs.publish import push
from deltafs.read.dest import LocalCheckpoint
from deltafs.read.pull import pull
from deltafs.testing.checkpoints import files_of, perturb, write_safetensors


def _write(path, data: bytes) -> None:
    write_safetensors(str(path / "model.safetensors"), {"w": ("BF16", (len(data) // 2,), data)})


def _cache_file(cache: str) -> os.stat_result:
    state = LocalCheckpoint(os.path.join(cache, "base")).state()
    assert state is not None
    return os.stat(os.path.join(state.path, "model.safetensors"))


def test_the_cache_links_new_files_and_copies_once_a_file_is_rewritten_in_place(tmp_path):
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    store, cache = str(tmp_path / "store"), str(tmp_path / "cache")
    src = tmp_path / "src"
    src.mkdir()
    _write(src, data)
    push(store, str(src), cache_dir=cache)
    st = os.stat(src / "model.safetensors")
    # On a filesystem with reflinks the cache file is a clone (another inode); else a hard link.
    linked = (_cache_file(cache).st_dev, _cache_file(cache).st_ino) == (st.st_dev, st.st_ino)
    # The trainer rewrites the same file in place (same inode): the base the cache held is gone.
    for _step in range(3):
        data = perturb(data, 2, 0.01, rng)
        with open(src / "model.safetensors", "r+b") as fh:
            fh.seek(os.path.getsize(src / "model.safetensors") - len(data))
            fh.write(data)
        res = push(store, str(src), cache_dir=cache)
        assert res.kind == "delta" and res.changed_fraction < 0.05
        pull(store, str(tmp_path / "dest"))
        assert files_of(tmp_path / "dest") == files_of(src)
    if linked:
        assert os.path.exists(os.path.join(cache, "no-link"))
        assert (_cache_file(cache).st_ino) != os.stat(src / "model.safetensors").st_ino
