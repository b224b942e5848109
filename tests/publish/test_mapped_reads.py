"""A push reads large chunks of local files as views of the page cache (deltafs.buffers.mapped_range): the same
bytes as a read, a file cut short is a clear error (never a SIGBUS), and a patched push cache is read before it is
written."""

from __future__ import annotations

import os

import numpy as np
import pytest

import deltafs.buffers as buffers
import deltafs.publish.encode as encode_mod
from deltafs.buffers import mapped_range
from deltafs.errors import SourceError, exit_code
from deltafs.format.manifest import Segment
from deltafs.publish import push
from deltafs.read.dest import LocalCheckpoint
from deltafs.read.pull import pull
from deltafs.store.repo import Repository
from deltafs.testing.checkpoints import files_of, perturb, write_safetensors


def test_a_mapped_range_holds_the_files_bytes_at_any_offset(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset, size in [(0, 1), (8, 4096), (4095, 70_000), (1 << 20, 2 << 20), (len(data) - 5, 5)]:
            view = mapped_range(fd, size, offset)
            assert view is not None and view.readonly and bytes(view) == data[offset:offset + size]
    finally:
        os.close(fd)


def test_a_range_past_the_end_is_an_eof_error_before_and_after_the_file_is_cut(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * (1 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(EOFError):
            mapped_range(fd, 4096, (1 << 20) - 100)  # runs past the end
        os.truncate(path, 8192)  # the file shrinks after it was opened: the populate, not an access, sees it
        with pytest.raises(EOFError):
            mapped_range(fd, 65536, 0)
        assert bytes(mapped_range(fd, 8192, 0)) == b"x" * 8192
    finally:
        os.close(fd)


def test_what_cannot_be_mapped_is_left_to_a_read():
    r, w = os.pipe()
    try:
        assert mapped_range(r, 4096, 0) is None
    finally:
        os.close(r)
        os.close(w)


def test_a_kernel_that_refuses_the_populate_turns_mapping_off_for_the_process(tmp_path, monkeypatch):
    """Without MADV_POPULATE_READ (Linux < 5.14) a short file would be a SIGBUS: such a kernel answers EINVAL, and
    every later range is read instead (None), never mapped unpopulated. Simulated with an advice no kernel knows."""
    path = tmp_path / "f"
    path.write_bytes(b"y" * 65536)
    monkeypatch.setattr(buffers, "MADV_POPULATE_READ", 0x7FFF)
    monkeypatch.setitem(buffers._mapping, "ok", True)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert mapped_range(fd, 4096, 0) is None
        assert buffers._mapping["ok"] is False
        monkeypatch.setattr(buffers, "MADV_POPULATE_READ", 22)
        assert mapped_range(fd, 4096, 0) is None  # off for the process from then on
    finally:
        os.close(fd)


def _ckpt(path, tensors: dict[str, np.ndarray]) -> str:
    path.mkdir(exist_ok=True)
    write_safetensors(str(path / "model.safetensors"),
                      {n: ("BF16", a.shape, a.tobytes()) for n, a in tensors.items()})
    return str(path)


def _spy(monkeypatch) -> list[tuple[int, int]]:
    """(size, offset) of every chunk the encoder read through a mapping."""
    seen: list[tuple[int, int]] = []
    real = encode_mod.mapped_range

    def spy(fd: int, size: int, offset: int):
        view = real(fd, size, offset)
        if view is not None:
            seen.append((size, offset))
        return view

    monkeypatch.setattr(encode_mod, "mapped_range", spy)
    return seen


@pytest.mark.parametrize("link", ["auto", "copy"], ids=["linked-cache", "patched-cache"])
def test_large_chunks_go_through_mappings_and_every_version_is_exact(tmp_path, monkeypatch, link):
    """A 3 MiB and a 600 KiB tensor (mapped) beside small ones (read); with a patched cache the mapped base is the
    file the push writes into: its chunks are read and checked before they are overwritten (no rebuild)."""
    seen = _spy(monkeypatch)
    rng = np.random.default_rng(3)
    v = {"big": rng.integers(0, 1 << 16, 3 << 19, dtype=np.uint16),
         "mid": rng.integers(0, 1 << 16, 300 << 10, dtype=np.uint16),
         "norm": rng.integers(0, 1 << 16, 512, dtype=np.uint16)}
    store, cache, dest = str(tmp_path / "store"), str(tmp_path / "cache"), str(tmp_path / "dest")
    push(store, _ckpt(tmp_path / "v1", v), cache_dir=cache, link=link)
    seen.clear()
    for step in range(2, 5):
        v = {n: np.frombuffer(perturb(a.tobytes(), 2, 0.02, rng), np.uint16) for n, a in v.items()}
        src = _ckpt(tmp_path / f"v{step}", v)
        res = push(store, src, cache_dir=cache, link=link)
        assert res.kind == "delta" and not res.base_rederived
        assert seen and all(size > encode_mod.SMALL_CHUNK for size, _ in seen)  # new and base of the large ones
        seen.clear()
        assert files_of(LocalCheckpoint(os.path.join(cache, "base")).state().path) == files_of(src)
        pull(store, dest)
        assert files_of(dest) == files_of(src)


def test_a_source_cut_short_while_it_is_pushed_fails_with_a_clear_error_and_commits_nothing(tmp_path, monkeypatch):
    rng = np.random.default_rng(5)
    v = {"big": rng.integers(0, 1 << 16, 1 << 20, dtype=np.uint16)}
    store, cache = str(tmp_path / "store"), str(tmp_path / "cache")
    push(store, _ckpt(tmp_path / "v1", v), cache_dir=cache)
    src = _ckpt(tmp_path / "v2", {"big": np.frombuffer(perturb(v["big"].tobytes(), 2, 0.02, rng), np.uint16)})
    real = encode_mod.Encoder._encode_file

    def cut_then_encode(self, f, ctx):  # the trainer truncates the file after deltafs scanned it
        os.truncate(f.abspath, f.size // 2)
        return real(self, f, ctx)

    monkeypatch.setattr(encode_mod.Encoder, "_encode_file", cut_then_encode)
    seen = _spy(monkeypatch)
    with pytest.raises(SourceError, match="model.safetensors shrank while it was being pushed") as caught:
        push(store, src, cache_dir=cache)
    assert exit_code(caught.value) == 2  # a bad source, as documented
    assert seen  # the chunks before the cut were read through mappings
    assert Repository.open(store).versions() == [1]


def test_a_patched_v1_base_is_never_mapped():
    tree = Segment(key="t:w", kind="tensor", offset=8, size=4, digest="xxh3-tree:" + "0" * 32, chunks=())
    v1 = Segment(key="t:v", kind="tensor", offset=12, size=4, digest="xxh3-128:" + "0" * 32, chunks=())
    assert encode_mod.may_map_bases(True, [tree]) and encode_mod.may_map_bases(False, [tree, v1])
    assert not encode_mod.may_map_bases(True, [tree, v1])
