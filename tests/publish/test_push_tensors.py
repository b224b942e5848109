"""push_tensors: streamed without a temporary checkpoint, keeps the previous version's plain files, takes DTensors."""

from __future__ import annotations

import os
import socket
import tempfile

import pytest
import torch
from safetensors.torch import load_file

from deltafs.publish import PushOptions, push, push_tensors
from deltafs.read.pull import pull
from deltafs.store.repo import Repository


def _weights(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 64, generator=gen).bfloat16(), "b": torch.randn(64, generator=gen)}


def test_no_temporary_checkpoint_is_written(tmp_path, monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setenv("TMPDIR", str(tmp))
    store = str(tmp_path / "store")
    push_tensors(store, _weights(0), cache_dir=str(tmp_path / "cache"))
    push_tensors(store, _weights(1), cache_dir=str(tmp_path / "cache"))
    assert os.listdir(tmp) == []
    pull(store, str(tmp_path / "dest"))
    got = load_file(str(tmp_path / "dest" / "model.safetensors"))
    assert all(torch.equal(got[n], t) for n, t in _weights(1).items())


def test_plain_files_of_the_previous_version_are_kept_unless_told_otherwise(tmp_path):
    store, cache = str(tmp_path / "store"), str(tmp_path / "cache")
    first = {"config.json": b'{"v": 1}', "tokenizer.json": b'{"tok": 1}', "generation_config.json": b'{"t": 1}'}
    push_tensors(store, _weights(0), extra_files=first, cache_dir=cache)
    push_tensors(store, _weights(1), extra_files={"config.json": b'{"v": 2}'}, cache_dir=cache)
    pull(store, str(tmp_path / "dest"))
    dest = tmp_path / "dest"
    assert sorted(os.listdir(dest)) == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    assert (dest / "config.json").read_bytes() == b'{"v": 2}' and (dest / "tokenizer.json").read_bytes() == b'{"tok": 1}'
    # From a fresh cache too (the files come from the store), and keep_files=False drops them.
    push_tensors(store, _weights(2), cache_dir=str(tmp_path / "other-cache"))
    assert {f.path for f in Repository.open(store).manifest(3).files} == set(os.listdir(dest))
    push_tensors(store, _weights(3), keep_files=False, cache_dir=cache)
    assert [f.path for f in Repository.open(store).manifest(4).files] == ["model.safetensors"]


def test_options_object_and_keywords(tmp_path):
    store = str(tmp_path / "store")
    res = push_tensors(store, _weights(0), PushOptions(version=10, metadata={"step": 3}), cache_dir=str(tmp_path / "c"))
    assert (res.version, res.metadata) == (10, {"step": 3})
    with pytest.raises(TypeError, match="unexpected push option 'tmp_dir'"):
        push_tensors(store, _weights(1), tmp_dir=str(tmp_path))  # type: ignore[call-arg]
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"x" * 100)
    assert push(store, str(src), PushOptions(full=True), level=1).kind == "full"


def test_a_dtensor_state_dict_on_a_world_of_one(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        plain = _weights(0)
        state = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in plain.items()}
        store = str(tmp_path / "store")
        push_tensors(store, state, cache_dir=str(tmp_path / "cache"))
    finally:
        dist.destroy_process_group()
    pull(store, str(tmp_path / "dest"))
    got = load_file(str(tmp_path / "dest" / "model.safetensors"))
    assert all(torch.equal(got[n], t) for n, t in plain.items())


def test_tensors_from_memory_patch_the_push_cache_in_place(tmp_path):
    from deltafs.read.dest import LocalCheckpoint

    store, cache = str(tmp_path / "store"), str(tmp_path / "cache")
    config = {"config.json": b'{"hidden": 8}'}
    for step in range(3):
        res = push_tensors(store, _weights(step), extra_files=config, cache_dir=cache)
        state = LocalCheckpoint(os.path.join(cache, "base")).state()
        st = os.stat(os.path.join(state.path, "model.safetensors"))
        if step == 0:
            first = st.st_ino
        else:
            assert res.kind == "delta" and not res.base_rederived
            assert st.st_ino == first  # the cached file itself took the changed chunks
        pull(store, str(tmp_path / "dest"))
        got = load_file(str(tmp_path / "dest" / "model.safetensors"))
        assert all(torch.equal(got[k], v) for k, v in _weights(step).items())
        with open(os.path.join(state.path, "model.safetensors"), "rb") as a, \
                open(tmp_path / "dest" / "model.safetensors", "rb") as b:
            assert a.read() == b.read()


def _near(step: int) -> dict[str, torch.Tensor]:
    """_weights(0) with a few elements moved per step, like an optimizer step (a delta, not a new keyframe)."""
    out = {k: v.clone() for k, v in _weights(0).items()}
    for v in out.values():
        v.view(-1)[:: 97][: step + 1] += 0.25
    return out


def test_kept_plain_files_stay_right_when_the_cache_is_patched(tmp_path):
    from deltafs.read.dest import LocalCheckpoint

    store, cache = str(tmp_path / "store"), str(tmp_path / "cache")
    first = {"config.json": b'{"v": 1}', "tokenizer.json": b'{"tok": 1}'}
    push_tensors(store, _near(0), extra_files=first, cache_dir=cache)
    inode = os.stat(os.path.join(LocalCheckpoint(os.path.join(cache, "base")).state().path, "model.safetensors")).st_ino
    for step in (1, 2, 3):  # config.json given again, tokenizer.json kept from the version before
        res = push_tensors(store, _near(step), extra_files={"config.json": b'{"v": 2}'}, cache_dir=cache, fold=True)
        assert res.kind == "delta" and not res.base_rederived
        state = LocalCheckpoint(os.path.join(cache, "base")).state()
        assert os.stat(os.path.join(state.path, "model.safetensors")).st_ino == inode
        pull(store, str(tmp_path / "dest"))
        assert (tmp_path / "dest" / "tokenizer.json").read_bytes() == b'{"tok": 1}'
        assert (tmp_path / "dest" / "config.json").read_bytes() == b'{"v": 2}'
        got = load_file(str(tmp_path / "dest" / "model.safetensors"))
        assert all(torch.equal(got[k], v) for k, v in _near(step).items())
    assert res.fold_bytes > 0  # the fold read the kept file from the installed cache, not the stage it left


@pytest.mark.parametrize("when", ["encode", "copy"])
def test_a_tensor_written_while_it_is_pushed_is_refused(tmp_path, monkeypatch, when):
    """An optimizer step overlapping push_tensors (a host tensor is read in place) used to publish a version whose
    payload and digest came from different bytes: reported as a success, unpullable, and every later push built on
    it. Now the push fails (SourceError, exit 2, as for a file rewritten while pushed), the store stays at the
    previous version, and the next push is whole."""
    from deltafs.errors import SourceError
    from deltafs.maintenance.verify import verify
    from deltafs.publish import encode as encode_mod

    store, dest = str(tmp_path / "store"), str(tmp_path / "dest")
    w = {"w": torch.zeros(1 << 16), "b": torch.ones(64)}
    push_tensors(store, w)
    w["w"][0] = 1.0
    real = encode_mod.codec.encode if when == "encode" else encode_mod.pwrite_all

    def racing(*args, **kwargs):
        out = real(*args, **kwargs)
        w["w"][1] += 2.0  # the trainer's next step lands on the tensor being pushed
        return out

    monkeypatch.setattr(encode_mod.codec if when == "encode" else encode_mod,
                        "encode" if when == "encode" else "pwrite_all", racing)
    with pytest.raises(SourceError, match="tensor w changed while it was being pushed"):
        push_tensors(store, w)
    monkeypatch.undo()
    assert Repository.open(store).versions() == [1] and verify(store, all_versions=True).ok
    res = push_tensors(store, w)
    assert res.version == 2 and verify(store, all_versions=True).ok
    pull(store, dest)
    got = load_file(os.path.join(dest, "model.safetensors"))
    assert torch.equal(got["w"], w["w"]) and torch.equal(got["b"], w["b"])


def test_an_extra_safetensors_file_repeating_a_tensor_is_refused_before_any_chunk(tmp_path):
    """push_tensors encoded and stored every chunk, then failed at the manifest on a duplicate segment; the same
    layout from a directory (`deltafs push`) was refused up front. Both are refused before anything is written."""
    from safetensors.torch import save

    from deltafs.errors import SourceError

    store = str(tmp_path / "store")
    push_tensors(store, {"a": torch.ones(4)})

    def stored() -> list[str]:
        return sorted(os.path.join(d, f) for d, _, files in os.walk(store) for f in files)

    before = stored()
    with pytest.raises(SourceError, match="tensor a appears in both"):
        push_tensors(store, {"a": torch.zeros(4)}, extra_files={"adapter.safetensors": save({"a": torch.ones(2)})})
    assert stored() == before


def _views(step: int) -> dict[str, torch.Tensor]:
    """Non-contiguous tensors of every kind: transposed, sliced along an inner dimension, stepped, expanded,
    permuted 3-D, a column of a matrix, 0-D and empty, over odd sizes and several dtypes."""
    gen = torch.Generator().manual_seed(100 + step)
    base = torch.randn(37, 53, generator=gen)
    cube = torch.randn(5, 7, 9, generator=gen).to(torch.float16)
    wide = torch.randn(3, 2 * 4099, generator=gen).bfloat16()
    return {
        "t": base.t(),
        "inner": wide[:, ::2],
        "step": torch.arange(1000 + step, dtype=torch.int64)[::3],
        "expanded": torch.randn(1, 29, generator=gen).expand(31, 29),
        "permuted": cube.permute(2, 0, 1),
        "column": base[:, 5],
        "scalar": torch.tensor(3.5 + step),
        "empty": torch.zeros(0, 4)[:, ::2],
        "bools": (base > 0).t(),
        "c64": torch.randn(6, 8, generator=gen, dtype=torch.complex64).t(),
    }


def test_non_contiguous_tensors_are_read_a_range_at_a_time_and_pushed_exactly(tmp_path):
    """Each non-contiguous tensor was made contiguous up front, a second copy of all of them for the whole push
    (adversarial pass: +1.1 GiB RSS for 1 GiB of transposed views). StridedBytes copies the rows a range touches,
    in row-major order; any byte range, aligned or not, is what the contiguous tensor holds there."""
    from deltafs.publish.hf import StridedBytes, tensor_bytes

    for name, t in _views(0).items():
        assert not t.is_contiguous() or t.numel() <= 1, name
        whole = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        got = tensor_bytes(t)
        assert bytes(memoryview(got.read(0, got.nbytes) if isinstance(got, StridedBytes) else got)) == whole, name
        if isinstance(got, StridedBytes) and got.nbytes > 10:
            for start, size in ((0, 1), (1, 7), (3, got.nbytes - 5), (got.nbytes // 2, got.nbytes - got.nbytes // 2)):
                buf = torch.zeros(size + 16, dtype=torch.uint8).numpy()
                assert bytes(got.read(start, size, buf)) == whole[start:start + size], (name, start, size)
                assert bytes(got.read(start, size)) == whole[start:start + size], (name, start, size)
    store = str(tmp_path / "store")
    for step in range(3):
        push_tensors(store, _views(step), cache_dir=str(tmp_path / "cache"))
        dest = str(tmp_path / f"dest{step}")
        pull(store, dest)
        got = load_file(os.path.join(dest, "model.safetensors"))
        for name, t in _views(step).items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
            assert got[name].reshape(-1).view(torch.uint8).equal(t.contiguous().reshape(-1).view(torch.uint8)), name


def test_pushing_transposed_views_does_not_copy_them_all_at_once(tmp_path):
    """Peak RSS of a push of 256 MiB of transposed views stays far below a second copy of them (in a child
    process: the test run's own peak would hide it)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import resource, torch
        from deltafs.publish import push_tensors
        ts = {{f"w{{i}}": torch.randn(1024, 2048).t() for i in range(32)}}  # 256 MiB, every one non-contiguous
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        push_tensors({str(tmp_path / "store")!r}, ts, cache_dir={str(tmp_path / "cache")!r}, threads=2)
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    grew_mib = int(proc.stdout.strip().splitlines()[-1])
    assert grew_mib < 128, grew_mib  # a contiguous copy of each made it grow by ~256 MiB


def test_a_mapping_that_yields_a_name_twice_is_refused_by_name(tmp_path):
    """A custom Mapping yielding "a" twice was refused as "not a valid safetensors file: ... overlap at a"."""
    from collections.abc import Mapping

    class Twice(Mapping):
        def __getitem__(self, key):
            return torch.zeros(4)

        def __iter__(self):
            return iter(["a", "b", "a"])

        def __len__(self):
            return 3

    from deltafs.errors import UsageError

    with pytest.raises(UsageError, match="tensor 'a' appears twice"):
        push_tensors(str(tmp_path / "store"), Twice())
    assert not os.path.exists(tmp_path / "store" / "manifests")


def test_metadata_readers_would_refuse_is_refused_before_anything_is_written(tmp_path):
    """Metadata nested 150 levels deep was committed, and the manifest then failed every pull, log and gc of the
    store ("nested more than 32 levels deep", exit 5); 3,000 levels were a RecursionError. Metadata dense enough
    that readers take the manifest for a hostile one was caught only at the seal, worded as a damaged store."""
    from deltafs.errors import UsageError

    store = str(tmp_path / "s")
    w = {"w": torch.zeros(8)}

    def nested(depth: int) -> object:
        value: object = 1
        for _ in range(depth):
            value = [value]
        return value

    for depth in (31, 150, 3000):
        with pytest.raises(UsageError, match="metadata is nested more than 31 levels deep"):
            push_tensors(store, w, metadata={"deep": nested(depth)})
    with pytest.raises(UsageError, match="metadata holds .* JSON values .*: readers would refuse the manifest"):
        push_tensors(store, w, metadata={"x": [0] * 600_000})
    for count in (450_000, 100_000):  # 900 and 200 KB: a manifest of them and enough tensors is too dense
        with pytest.raises(UsageError, match="metadata holds .* JSON values in .* bytes: readers would refuse a "
                                             "manifest of it"):
            push_tensors(store, w, metadata={"x": [0] * count})
    assert not os.path.exists(os.path.join(store, "manifests"))
    dense = push_tensors(store, w, metadata={"x": [0] * 40_000})  # 80 KB of it: no manifest it is in is too dense
    assert Repository.open(store).manifest(dense.version).metadata["x"] == [0] * 40_000
    got = push_tensors(store, w, metadata={"deep": nested(30)})  # the deepest a reader takes
    assert Repository.open(store).manifest(got.version).metadata["deep"] == nested(30)
    pull(store, str(tmp_path / "d"))
    # The DEST's state record holds the manifest one level deeper: a fresh process still reads it.
    from deltafs.testing.checkpoints import run_cli

    proc = run_cli("pull", store, tmp_path / "d", "--once")
    assert proc.returncode == 100, proc.stderr


def test_a_manifest_is_checked_by_the_readers_limits_before_it_is_committed(tmp_path):
    """The writer's own check of a sealed manifest (Manifest.sealed) now applies the limits a reader applies to the
    text, whatever made it exceed them."""
    from deltafs.errors import FormatError
    from deltafs.format.manifest import Manifest

    store = str(tmp_path / "s")
    push_tensors(store, {"w": torch.zeros(8)})
    man = Repository.open(store).manifest(1)
    deep: object = 1
    for _ in range(40):
        deep = [deep]
    from dataclasses import replace

    with pytest.raises(FormatError, match="manifest of version 1 is nested more than 32 levels deep"):
        replace(man, metadata={"deep": deep}).sealed()
    assert isinstance(replace(man, metadata={"step": 2}).sealed(), Manifest)


def test_bad_shard_sizes_and_baselines_are_usage_errors(tmp_path):
    """max_shard_bytes="5GB" was a TypeError from deep inside, 0 and -1 one shard per tensor; a device_baseline that
    is not a DeviceBaseline an AttributeError."""
    from deltafs.errors import UsageError

    w = {"a": torch.zeros(8), "b": torch.zeros(8)}
    for bad in ("5GB", 0, -1, 1.5, True):
        with pytest.raises(UsageError, match="max_shard_bytes must be an integer of at least 1"):
            push_tensors(str(tmp_path / "s"), w, max_shard_bytes=bad)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="device_baseline must be a deltafs.DeviceBaseline, not object"):
        push_tensors(str(tmp_path / "s"), w, device_baseline=object())  # type: ignore[arg-type]
    assert not os.path.exists(tmp_path / "s" / "manifests")
