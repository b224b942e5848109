"""A source file written while it is pushed: the push fails with exit 2 naming it and commits nothing, whether or
not any read came back short. A rewrite in place at the same size gives no short read and no digest can tell: each
chunk holds whichever version it was read in. The file's size and modification time, taken when it is opened and
again after its last chunk, tell."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import deltafs.publish.encode as encode_mod
from deltafs.errors import SourceError, exit_code
from deltafs.publish import push
from deltafs.read.pull import pull
from deltafs.store.repo import Repository
from deltafs.testing.checkpoints import files_of, perturb, write_safetensors


def _ckpt(path, a: np.ndarray) -> str:
    path.mkdir()
    write_safetensors(str(path / "model.safetensors"), {"w": ("BF16", a.shape, a.tobytes())})
    (path / "config.json").write_text('{"step": 1}')
    return str(path)


def _versions(tmp_path):
    rng = np.random.default_rng(21)
    a = rng.integers(0, 1 << 16, 3 << 20, dtype=np.uint16)  # 6 MiB: two chunks
    store, cache = str(tmp_path / "store"), str(tmp_path / "cache")
    push(store, _ckpt(tmp_path / "v1", a), cache_dir=cache)
    src = _ckpt(tmp_path / "v2", np.frombuffer(perturb(a.tobytes(), 2, 0.02, rng), np.uint16))
    return store, cache, src


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_a_file_rewritten_in_place_at_the_same_size_mid_push_fails_the_push(tmp_path, monkeypatch, name):
    store, cache, src = _versions(tmp_path)
    real, done = encode_mod.Encoder._chunk, []

    def chunk_then_write(self, reader, *args, **kw):
        out = real(self, reader, *args, **kw)
        if not done and reader.path.endswith(name):  # after the file's first chunk: rewritten in place, same size
            done.append(True)
            time.sleep(0.05)  # past the coarse clock's tick that stamped the open
            path = os.path.join(src, name)
            with open(path, "r+b") as fh:
                fh.seek(os.path.getsize(path) - 2)
                fh.write(b"}}" if name == "config.json" else b"\x01\x02")
        return out

    monkeypatch.setattr(encode_mod.Encoder, "_chunk", chunk_then_write)
    with pytest.raises(SourceError, match=f"{name} was written while it was being pushed") as caught:
        push(store, src, cache_dir=cache)
    assert exit_code(caught.value) == 2 and done
    assert Repository.open(store).versions() == [1]


def test_a_file_grown_between_its_scan_and_its_push_fails_the_push(tmp_path, monkeypatch):
    store, cache, src = _versions(tmp_path)
    real = encode_mod.Encoder._encode_file

    def append_then_encode(self, f, ctx):
        if f.path == "config.json":
            with open(f.abspath, "a") as fh:
                fh.write(" ")
        return real(self, f, ctx)

    monkeypatch.setattr(encode_mod.Encoder, "_encode_file", append_then_encode)
    with pytest.raises(SourceError, match="config.json was written while it was being pushed"):
        push(store, src, cache_dir=cache)
    assert Repository.open(store).versions() == [1]


def test_an_untouched_source_pushes_even_though_the_cache_links_it(tmp_path):
    """The push cache hard-links the source (a new link moves the file's change time, not its modification time)."""
    store, cache, src = _versions(tmp_path)
    res = push(store, src, cache_dir=cache)
    assert res.kind == "delta"
    assert os.stat(os.path.join(src, "model.safetensors")).st_nlink == 2  # linked into the cache
    pull(store, str(tmp_path / "dest"))
    assert files_of(str(tmp_path / "dest")) == files_of(src)
