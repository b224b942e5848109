"""A push reads large chunks of local files as views of the page cache (deltafs.buffers.mapped_range): the same
bytes as a read, a file cut short is a clear error (never a SIGBUS, also while a view of it is being read:
deltafs/_mapped.c), and a patched push cache is read before it is written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

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


@pytest.mark.parametrize("cut", ["first", "last"])
def test_a_run_of_small_tensors_cut_short_while_it_is_encoded_fails_the_push(tmp_path, monkeypatch, cut):
    """Small tensors are read as one span per run, through a mapping once the span is large; the run's chunks are
    checked together after their last use: a cut while any of them is encoded fails the push, commits nothing,
    and the next push of a whole file works."""
    rng = np.random.default_rng(6)
    v = {f"norm.{k:02d}": rng.integers(0, 1 << 16, 40_000, dtype=np.uint16) for k in range(12)}  # 12 x 80 KB
    store, cache, dest = str(tmp_path / "store"), str(tmp_path / "cache"), str(tmp_path / "dest")
    push(store, _ckpt(tmp_path / "v1", v), cache_dir=cache)
    v2 = {n: np.frombuffer(perturb(a.tobytes(), 2, 0.05, rng), np.uint16) for n, a in v.items()}
    src = _ckpt(tmp_path / "v2", v2)
    seen = _spy(monkeypatch)
    real = encode_mod.codec.encode
    calls = []

    def cut_during_the_run(new, old, *args, **kwargs):
        calls.append(1)
        if len(calls) == (1 if cut == "first" else len(v)):
            os.truncate(os.path.join(src, "model.safetensors"), 4096)  # the trainer rewrites the file
        return real(new, old, *args, **kwargs)

    monkeypatch.setattr(encode_mod.codec, "encode", cut_during_the_run)
    with pytest.raises(SourceError, match="model.safetensors shrank while it was being pushed"):
        push(store, src, cache_dir=cache)
    assert any(size > encode_mod.SMALL_CHUNK for size, _ in seen)  # the run's span was mapped
    assert Repository.open(store).versions() == [1]
    monkeypatch.setattr(encode_mod.codec, "encode", real)
    src = _ckpt(tmp_path / "v2", v2)  # written whole again
    assert push(store, src, cache_dir=cache).version == 2
    pull(store, dest)
    assert files_of(dest) == files_of(src)


def test_without_the_guarded_mappings_every_chunk_is_read(tmp_path, monkeypatch):
    """A build without deltafs._mapped (no C compiler, not Linux) maps nothing: the same versions, through reads."""
    monkeypatch.setitem(buffers._mapping, "ok", False)
    seen = _spy(monkeypatch)
    rng = np.random.default_rng(11)
    v = {"big": rng.integers(0, 1 << 16, 3 << 19, dtype=np.uint16)}
    store, cache, dest = str(tmp_path / "store"), str(tmp_path / "cache"), str(tmp_path / "dest")
    push(store, _ckpt(tmp_path / "v1", v), cache_dir=cache)
    src = _ckpt(tmp_path / "v2", {"big": np.frombuffer(perturb(v["big"].tobytes(), 2, 0.02, rng), np.uint16)})
    assert push(store, src, cache_dir=cache).kind == "delta"
    pull(store, dest)
    assert files_of(dest) == files_of(src) and not seen


def test_a_fault_over_bytes_the_file_still_has_is_called_an_io_error(tmp_path, monkeypatch):
    """A SIGBUS in a mapping of a file as long as ever is an I/O error (a page that could not be read back), not a
    cut: the same exit 2, with words that send the operator to the disk. Simulated: the guard's mark, set."""
    rng = np.random.default_rng(13)
    v = {"big": rng.integers(0, 1 << 16, 1 << 20, dtype=np.uint16)}
    store, cache = str(tmp_path / "store"), str(tmp_path / "cache")
    push(store, _ckpt(tmp_path / "v1", v), cache_dir=cache)
    src = _ckpt(tmp_path / "v2", {"big": np.frombuffer(perturb(v["big"].tobytes(), 2, 0.02, rng), np.uint16)})
    monkeypatch.setattr(encode_mod, "cut_short", lambda view, fd: buffers.is_mapped(view))
    with pytest.raises(SourceError, match="could not be read while it was being pushed .*an I/O error") as caught:
        push(store, src, cache_dir=cache)
    assert exit_code(caught.value) == 2 and Repository.open(store).versions() == [1]


def test_a_patched_v1_base_is_never_mapped():
    tree = Segment(key="t:w", kind="tensor", offset=8, size=4, digest="xxh3-tree:" + "0" * 32, chunks=())
    v1 = Segment(key="t:v", kind="tensor", offset=12, size=4, digest="xxh3-128:" + "0" * 32, chunks=())
    assert encode_mod.may_map_bases(True, [tree]) and encode_mod.may_map_bases(False, [tree, v1])
    assert not encode_mod.may_map_bases(True, [tree, v1])


# --- a file cut short while its view is read (deltafs/_mapped.c) ----------------------------------------------
# Each case runs in its own process: a SIGBUS that the guard failed to catch ends that process, not the test run.

def _run(code: str, tmp_path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), str(tmp_path)], capture_output=True,
                          text=True, timeout=120)


def test_the_guarded_mappings_are_built_where_the_codec_loops_are():
    """CI has a compiler: if the build silently skipped deltafs._mapped there, pushes would read every chunk and
    the guard below would go untested."""
    from deltafs.codec import native

    if not native.BUILT:
        pytest.skip("no C compiler here")
    assert buffers._mapped is not None and buffers._mapping["ok"]


def test_a_file_cut_short_while_its_view_is_read_reads_zeros_and_is_marked(tmp_path):
    out = _run("""
        import os, sys
        from deltafs.buffers import faulted, mapped_range
        path = os.path.join(sys.argv[1], "f")
        with open(path, "wb") as fh:
            fh.write(b"a" * (3 << 20))
        fd = os.open(path, os.O_RDONLY)
        view = mapped_range(fd, 2 << 20, 4096 + 5)
        part = view[1 << 20:]  # a slice shares the mapping and its mark
        assert bytes(view[:4]) == b"aaaa" and not faulted(view) and not faulted(part)
        os.truncate(path, 1 << 20)  # the trainer rewrites the file in place
        data = bytes(view)  # without the guard: SIGBUS here
        cut = (1 << 20) - 4096 - 5
        assert data[:cut] == b"a" * cut and data[cut:] == bytes(len(data) - cut), "zeros where the file is gone"
        assert faulted(view) and faulted(part) and not faulted(b"a") and not faulted(memoryview(b"a"))
        print("survived")
    """, tmp_path)
    assert out.returncode == 0 and "survived" in out.stdout, out.stderr


def test_a_cut_inside_a_views_last_page_faults_nothing_but_is_seen(tmp_path):
    """The part of a file's last page past its end reads as zeros without a fault: cut_short compares sizes too."""
    out = _run("""
        import os, sys
        from deltafs.buffers import cut_short, faulted, mapped_range
        path = os.path.join(sys.argv[1], "f")
        with open(path, "wb") as fh:
            fh.write(b"c" * 20_000)
        fd = os.open(path, os.O_RDONLY)
        view, before = mapped_range(fd, 12_000, 100), mapped_range(fd, 8_000, 0)
        os.truncate(path, 12_000)  # inside the page that holds the view's last byte (12,099)
        data = bytes(view)
        assert data == b"c" * 11_900 + bytes(100), "zeros past the cut, within the page"
        assert not faulted(view) and cut_short(view, fd)
        assert bytes(before) == b"c" * 8_000 and not cut_short(before, fd)  # ends before the cut: intact
        assert not cut_short(memoryview(b"c"), fd)
        print("seen")
    """, tmp_path)
    assert out.returncode == 0 and "seen" in out.stdout, out.stderr


def test_threads_mapping_and_cutting_their_files_at_once_never_read_unmarked_zeros(tmp_path):
    """The guard's table under concurrent use: 4 threads for 2 s each map 1-6 random ranges of their own file, cut
    it at a random size half the time, read every view. Each view is exact or seen as cut short; none kills the
    process. (A 15 s run with 8 threads is in docs/profile.md, round 17.)"""
    out = _run("""
        import os, random, sys, threading, time
        from deltafs.buffers import cut_short, mapped_range
        root, bad, seen = sys.argv[1], [], [0, 0]

        def worker(k):
            rng, end = random.Random(k), time.time() + 2.0
            path = os.path.join(root, f"f{k}")
            while time.time() < end:
                size = rng.choice([300_000, 1 << 20, 4 << 20])
                data = bytes([k + 1]) * size
                with open(path, "wb") as fh:
                    fh.write(data)
                fd = os.open(path, os.O_RDONLY)
                try:
                    views = []
                    for _ in range(rng.randint(1, 6)):
                        off = rng.randrange(0, size - 4096)
                        n = rng.randrange(1, size - off)
                        views.append((off, n, mapped_range(fd, n, off)))
                    if rng.random() < 0.5:
                        os.truncate(path, rng.randrange(0, size))
                    for off, n, view in views:
                        got = bytes(view)
                        if cut_short(view, fd):
                            seen[1] += 1
                            kept = got.rstrip(bytes(1))
                            if kept != data[off:off + len(kept)]:
                                bad.append((k, off, n, "cut"))
                        else:
                            seen[0] += 1
                            if got != data[off:off + n]:
                                bad.append((k, off, n, "unmarked"))
                    del views, view
                finally:
                    os.close(fd)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not bad, bad[:5]
        assert seen[0] > 50 and seen[1] > 50, seen
        print("views", seen)
    """, tmp_path)
    assert out.returncode == 0 and "views" in out.stdout, out.stderr


def test_a_sigbus_outside_deltafs_mappings_still_ends_the_process(tmp_path):
    """The guard handles only addresses of its own mappings; any other SIGBUS goes where it went before: here to
    faulthandler (enabled first, as pytest and PYTHONFAULTHANDLER do), which reports it, and the process dies."""
    out = _run("""
        import faulthandler, mmap, os, sys
        faulthandler.enable()
        from deltafs.buffers import mapped_range
        path = os.path.join(sys.argv[1], "f")
        with open(path, "wb") as fh:
            fh.write(b"b" * (1 << 20))
        fd = os.open(path, os.O_RDONLY)
        assert mapped_range(fd, 1 << 20, 0) is not None  # the guard is installed
        other = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)  # a mapping deltafs did not make
        os.truncate(path, 4096)
        print("before", flush=True)
        other[500_000]
        print("not reached", flush=True)
    """, tmp_path)
    assert out.returncode == -signal.SIGBUS and "before" in out.stdout and "not reached" not in out.stdout
    assert "Bus error" in out.stderr  # faulthandler's report


@pytest.mark.parametrize("which", ["source", "source-last-page", "base"])
def test_a_file_cut_short_between_its_mapping_and_its_compare_fails_the_push_cleanly(tmp_path, which):
    """The trainer truncates the checkpoint (or something truncates the push cache) just after a large chunk of it
    was mapped: the compare reads zeros, not SIGBUS. A source cut short is exit 2 naming the file, nothing
    committed; a cache cut short is a cache the push does not trust (the base is rebuilt from the store)."""
    out = _run(f"""
        import os, sys
        import numpy as np
        import deltafs.publish.encode as encode_mod
        from deltafs.errors import SourceError, exit_code
        from deltafs.publish import push
        from deltafs.store.repo import Repository
        from deltafs.testing.checkpoints import files_of, perturb, write_safetensors
        root = sys.argv[1]
        store, cache = os.path.join(root, "store"), os.path.join(root, "cache")

        def ckpt(name, a):
            os.makedirs(os.path.join(root, name))
            write_safetensors(os.path.join(root, name, "model.safetensors"), {{"big": ("BF16", a.shape, a.tobytes())}})
            return os.path.join(root, name)

        rng = np.random.default_rng(7)
        a = rng.integers(0, 1 << 16, 3 << 20, dtype=np.uint16)
        push(store, ckpt("v1", a), cache_dir=cache, link="copy")
        src = ckpt("v2", np.frombuffer(perturb(a.tobytes(), 2, 0.02, rng), np.uint16))
        real, cut = encode_mod.mapped_range, []

        def map_then_cut(fd, size, offset):
            view = real(fd, size, offset)
            path = os.readlink(f"/proc/self/fd/{{fd}}")
            # The source's last chunk (no later read would see the file shorter), or the cache's first.
            wanted = path.startswith(src) and offset > (4 << 20) if "{which}" != "base" else path.startswith(cache)
            if view is not None and wanted and not cut:
                # To nothing; or one byte short, inside the last page: no fault, a zero only the size check sees.
                size = os.path.getsize(path)
                assert size % 4096 != 1  # else the last page would hold that byte alone, and fault
                os.truncate(path, size - 1 if "{which}" == "source-last-page" else 0)
                cut.append(path)
            return view

        encode_mod.mapped_range = map_then_cut
        try:
            res = push(store, src, cache_dir=cache, link="copy")
        except SourceError as exc:
            print("error", exit_code(exc), exc)
        else:
            print("pushed", res.version, res.base_rederived, files_of(src) == files_of(os.path.join(cache, "base")))
        print("cut", bool(cut), "versions", Repository.open(store).versions())
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    if which.startswith("source"):
        assert "error 2 " in out.stdout and "model.safetensors shrank while it was being pushed" in out.stdout
        assert "cut True versions [1]" in out.stdout
    else:
        assert "pushed 2 True" in out.stdout and "cut True versions [1, 2]" in out.stdout, out.stdout
