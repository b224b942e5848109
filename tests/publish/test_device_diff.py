"""A DeviceBaseline: a push copies only the changed elements of accelerator tensors to the host, and never publishes
bytes other than the tensors'.

This machine has no accelerator: the accelerator path (DeviceBytes, the torch ops of deltafs.publish.device_diff)
runs on CPU tensors here, by making push_tensors treat them as it treats a contiguous accelerator tensor. The ops
are the same on every device; the device row of the benchmark (benchmarks/device_diff.py --device cuda) is the
accelerator's own check.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from deltafs.errors import UsageError
from deltafs.publish import DeviceBaseline, push_tensors
from deltafs.publish import hf as hf_mod
from deltafs.publish.hf import DeviceBytes
from deltafs.read.pull import pull
from deltafs.store.repo import Repository


@pytest.fixture(autouse=True)
def _cpu_as_device(monkeypatch):
    """Every tensor behind DeviceBytes, as a contiguous accelerator tensor is."""
    monkeypatch.setattr(hf_mod, "tensor_bytes", lambda t, baseline=None, name="": DeviceBytes(t.detach(), baseline, name))


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(1024, 1536, generator=gen).bfloat16(),  # 3 MiB: three 1 MiB chunks
        "mid": torch.randn(300, 257, generator=gen),  # F32, 301 KiB: one chunk with a short tail
        "norm": torch.randn(700, generator=gen),  # tiny: below min_range, always copied whole
        "mask": torch.rand(33, generator=gen) > 0.5,  # bool, an odd size
    }


def _step(w: dict[str, torch.Tensor], step: int, every: int = 97) -> None:
    """A trainer-like step in place: about 1% of the elements move."""
    for name in ("big", "mid", "norm"):
        if name not in w:
            continue
        flat = w[name].view(-1)
        flat[step % every :: every] += 0.01 * (1 + flat[step % every :: every].abs())


def _store(path: str) -> str:
    Repository.open(path, create=True, chunk_bytes=1 << 20)
    return path


def _pulled(store: str, dest: str, name: str = "model.safetensors") -> dict[str, torch.Tensor]:
    pull(store, dest)
    return load_file(os.path.join(dest, name))


def _files(store: str, version: int) -> list[tuple[str, str, list[str | None]]]:
    man = Repository.open(store).manifest(version)
    return [(f.path, f.digest, [c.object for s in f.segments for c in s.chunks]) for f in man.files]


def _armed(tmp_path) -> tuple[str, dict[str, torch.Tensor], DeviceBaseline]:  # type: ignore[no-untyped-def]
    """A store holding the first version, pushed with a baseline that now holds it."""
    store = _store(str(tmp_path / "s"))
    w = _weights()
    base = DeviceBaseline()
    push_tensors(store, w, cache_dir=str(tmp_path / "c"), device_baseline=base)
    return store, w, base


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(-1).view(torch.uint8), b[k].contiguous().view(-1).view(torch.uint8))
                                        for k in a)


def test_pushes_copy_only_changed_elements_and_publish_the_tensors_bit_exact(tmp_path):
    store, plain = _store(str(tmp_path / "s")), _store(str(tmp_path / "plain"))
    w = _weights()
    base = DeviceBaseline()
    for step in range(4):
        if step:
            _step(w, step)
        got = push_tensors(store, w, cache_dir=str(tmp_path / "c"), device_baseline=base)
        ref = push_tensors(plain, {k: v.clone() for k, v in w.items()}, cache_dir=str(tmp_path / "c2"))
        st = base.last
        assert base.armed and st.mismatches == 0
        assert st.bytes_read == sum(t.numel() * t.element_size() for t in w.values())
        if step == 0:
            assert st.ranges_diffed == 0 and st.bytes_to_host == st.bytes_read  # nothing to compare with yet
        else:
            # big's three chunks and mid are rebuilt from their changes; ~1% changed: a few % of the bytes cross
            assert st.ranges_diffed == 4 and st.bytes_to_host < 0.05 * st.bytes_read
        # the same version as a push that copies every tensor whole: same chunks, same digests
        assert got.kind == ref.kind == ("full" if step == 0 else "delta")
        assert _files(store, got.version) == _files(plain, ref.version)
        assert _same_bits(_pulled(store, str(tmp_path / f"d{step}")), w)


@pytest.mark.parametrize("edit", ["step", "sign flips"])
def test_a_baseline_of_another_version_than_the_base_is_not_used(tmp_path, edit):
    store, w, base = _armed(tmp_path)
    # Another writer publishes in between: this host's push cache is stale, the push re-derives its base from the
    # store (that writer's version), which the baseline does not hold.
    other = {k: v.clone() for k, v in w.items()}
    if edit == "step":
        _step(other, 5)
    else:  # two sign flips: changes the word checksum alone cannot see (2 * 2**63 = 0 modulo 2**64)
        other["big"].view(-1)[3] *= -1
        other["big"].view(-1)[7] *= -1
    push_tensors(store, other, cache_dir=str(tmp_path / "other"))
    _step(w, 1)
    got = push_tensors(store, w, cache_dir=str(tmp_path / "c"), device_baseline=base)
    assert got.base_rederived and base.last.ranges_diffed == 0 and base.last.mismatches == 0
    assert base.last.bytes_to_host == base.last.bytes_read
    assert _same_bits(_pulled(store, str(tmp_path / "d1")), w)
    # The baseline now holds the version just pushed: the next push diffs again.
    repo = Repository.open(store)
    assert base.holds == (repo.store_id, got.version, got.digest) and got.digest == repo.manifest(got.version).digest
    _step(w, 2)
    push_tensors(store, w, cache_dir=str(tmp_path / "c"), device_baseline=base)
    assert base.last.mismatches == 0 and base.last.ranges_diffed == 4
    assert _same_bits(_pulled(store, str(tmp_path / "d2")), w)


def test_a_range_read_again_in_the_same_push_is_copied_whole(tmp_path):
    """The push cache fails its check mid-encode (a byte of its copy flipped): the push re-derives its base and
    encodes again within the same push. The first attempt's reads had already overwritten the baseline with the
    live bytes, and the second diffed live against live: the chunk was rebuilt from the base version's bytes, and
    two sign flips (invisible to the word checksum) were published as the previous step's values."""
    store = _store(str(tmp_path / "s"))
    gen = torch.Generator().manual_seed(0)
    # file order by name: a_big's three 1 MiB chunks are encoded before z_norm, where the cache is damaged
    w = {"a_big": torch.randn(1024, 768, generator=gen), "z_norm": torch.randn(10000, generator=gen)}
    base = DeviceBaseline()
    push_tensors(store, w, cache_dir=str(tmp_path / "c"), device_baseline=base)
    w["a_big"].view(-1)[1] *= -1
    w["a_big"].view(-1)[3] *= -1
    cached = os.path.realpath(str(tmp_path / "c" / "base" / "model.safetensors"))
    with open(cached, "r+b") as fh:
        fh.seek(os.path.getsize(cached) - 100)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0xFF]))
    got = push_tensors(store, w, cache_dir=str(tmp_path / "c"), device_baseline=base)
    assert got.base_rederived and base.last.mismatches == 0
    assert _same_bits(_pulled(store, str(tmp_path / "d")), w)
    assert base.holds == (Repository.open(store).store_id, got.version, got.digest)


def test_a_copy_of_the_store_is_another_store_to_the_baseline(tmp_path):
    """Two copies of one store (the same store id) each get their own version 2. The baseline told versions apart by
    store id and number only, so a push to the first copy diffed against the second copy's version 2 and rebuilt
    the chunks from the first's: the first's version 2 values came back (sign flips the checksum cannot see)."""
    import shutil

    p1 = _store(str(tmp_path / "s1"))
    w = {"w": torch.randn(512, 512, generator=torch.Generator().manual_seed(0))}
    base = DeviceBaseline()
    push_tensors(p1, w, cache_dir=str(tmp_path / "c"), device_baseline=base)
    p2 = str(tmp_path / "s2")
    shutil.copytree(p1, p2)
    before = w["w"].clone()
    w["w"].view(-1)[1] *= -1
    w["w"].view(-1)[3] *= -1
    push_tensors(p1, w, cache_dir=str(tmp_path / "c"), device_baseline=base)  # p1's version 2: the flips
    w["w"].copy_(before)
    push_tensors(p2, w, cache_dir=str(tmp_path / "c"), device_baseline=base)  # p2's version 2: without them
    w["w"].view(-1)[7::1001] += 0.5
    got = push_tensors(p1, w, cache_dir=str(tmp_path / "c"), device_baseline=base)
    assert got.version == 3 and base.last.ranges_diffed == 0
    assert _same_bits(_pulled(p1, str(tmp_path / "d")), w)


def test_a_baseline_is_not_used_for_another_store(tmp_path):
    store, w, base = _armed(tmp_path)
    second = _store(str(tmp_path / "s2"))
    push_tensors(second, w, cache_dir=str(tmp_path / "c2"), device_baseline=base)  # its first version: full
    _step(w, 1)
    push_tensors(second, w, cache_dir=str(tmp_path / "c2"), device_baseline=base)
    assert base.last.ranges_diffed == 4  # the baseline follows the store it last pushed to
    w1 = {k: v.clone() for k, v in w.items()}
    _step(w, 2)
    push_tensors(store, w, cache_dir=str(tmp_path / "c"), device_baseline=base)  # back: its base is version 1
    assert base.last.ranges_diffed == 0
    assert _same_bits(_pulled(store, str(tmp_path / "d")), w)
    assert _same_bits(_pulled(second, str(tmp_path / "d2")), w1)


def test_a_fold_reads_the_cache_not_the_device(tmp_path):
    store, w, base = _armed(tmp_path)
    for step in (1, 2):  # the fold is written from the second delta after the full version
        _step(w, step)
        got = push_tensors(store, w, cache_dir=str(tmp_path / "c"), device_baseline=base, fold=True)
        assert base.last.bytes_read == sum(t.numel() * t.element_size() for t in w.values())
        assert base.last.ranges_diffed == 4
    assert got.fold_bytes > 0
    fresh = str(tmp_path / "fresh")
    pull(store, fresh, version=1)
    assert _same_bits(_pulled(store, fresh), w)  # 1 -> 3 through the fold


def test_a_damaged_baseline_never_reaches_the_store(tmp_path):
    store, w, base = _armed(tmp_path)
    _step(w, 1)  # element 1 of big moves
    # The device copy already holds the new value there (as if a bug wrote to it): the range looks unchanged at
    # element 1, so a rebuild from the base would keep the old value there.
    base._slots["big"].buf[2:4] = w["big"].view(-1)[1:2].view(torch.uint8)
    push_tensors(store, w, cache_dir=str(tmp_path / "c"), device_baseline=base)
    assert base.last.mismatches >= 1  # big's first chunk, at least
    assert _same_bits(_pulled(store, str(tmp_path / "d")), w)


def test_a_failed_push_disarms_the_baseline_and_the_next_push_copies_whole(tmp_path):
    store, w, base = _armed(tmp_path)
    _step(w, 1)
    with pytest.raises(UsageError, match="meta device"):
        push_tensors(store, {**w, "z": torch.empty(3, device="meta")}, cache_dir=str(tmp_path / "c"),
                     device_baseline=base)
    assert not base.armed
    _step(w, 2)
    push_tensors(store, w, cache_dir=str(tmp_path / "c"), device_baseline=base)
    assert base.last.ranges_diffed == 0 and base.armed
    assert _same_bits(_pulled(store, str(tmp_path / "d")), w)


def test_dense_changes_and_new_shapes_are_copied_whole(tmp_path):
    store, w, base = _armed(tmp_path)
    w["big"] += 1.0  # nearly every element: positions and values would move more than half the bytes
    w["mid"] = torch.randn(301, 256)  # same bytes, another shape: a new tensor for the baseline
    push_tensors(store, w, cache_dir=str(tmp_path / "c"), device_baseline=base)
    assert base.last.ranges_diffed == 0 and base.last.bytes_to_host == base.last.bytes_read
    assert _same_bits(_pulled(store, str(tmp_path / "d")), w)
    del w["norm"]  # a tensor the model no longer has leaves the baseline
    _step(w, 3)
    push_tensors(store, w, cache_dir=str(tmp_path / "c"), device_baseline=base)
    assert set(base._slots) == set(w) and base.last.ranges_diffed == 4
    assert _same_bits(_pulled(store, str(tmp_path / "d2")), w)


def test_one_push_at_a_time_and_bad_settings_are_refused():
    base = DeviceBaseline()
    base.begin()
    with pytest.raises(UsageError, match="another push"):
        base.begin()
    base.end(False)
    with pytest.raises(UsageError):
        DeviceBaseline(max_fraction=0.0)
    with pytest.raises(UsageError):
        DeviceBaseline(min_range=0)


def test_push_distributed_takes_a_baseline_too(tmp_path):
    from deltafs.publish import push_distributed

    store = _store(str(tmp_path / "s"))
    w = _weights()
    base = DeviceBaseline()
    for step in range(2):
        if step:
            _step(w, step)
        push_distributed(store, w, cache_dir=str(tmp_path / "c"), device_baseline=base)  # a world of one
        assert base.armed and base.last.ranges_diffed == (4 if step else 0)
    assert _same_bits(_pulled(store, str(tmp_path / "d"), "model-00001-of-00001.safetensors"), w)
