"""In-place apply into a live torch.nn.Module: bit-exact, only changed tensors, verified, rolled back on failure."""

from __future__ import annotations

import json
import shutil
import threading
import time

import numpy as np
import pytest
import torch
from sglang_standin import build_model, random_weights, tiny_config

from deltafs.engines.base import SwitchError, Target
from deltafs.engines.torch_module import ModuleApplier, TorchModuleEngine, tensor_digest
from deltafs.errors import EngineError
from deltafs.publish import push_tensors
from deltafs.read.pull import pull

CONFIG = tiny_config()


def assert_module_holds(module: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    live = module.state_dict()
    for name, t in expected.items():
        assert torch.equal(live[name].cpu().contiguous().view(torch.uint8), t.view(torch.uint8)), name


@pytest.fixture()
def versions(tmp_path):
    """Versions 1..3 pushed and pulled; 2 changes lm_head and the logit_bias buffer; 3 changes the embedding."""
    store, dest = str(tmp_path / "store"), str(tmp_path / "dest")
    w1 = random_weights(CONFIG, 1)
    w2 = {k: v.clone() for k, v in w1.items()}
    w2["lm_head.weight"][3] += 1
    w2["logit_bias"][5] = 0.25
    w3 = {k: v.clone() for k, v in w2.items()}
    w3["model.embed_tokens.weight"][0, 0] = 7.0
    paths = {}
    for n, w in ((1, w1), (2, w2), (3, w3)):
        push_tensors(store, w, extra_files={"config.json": json.dumps(CONFIG).encode()}, cache_dir=str(tmp_path / "cache"))
        paths[n] = pull(store, dest, keep=5).path
    return paths, {1: w1, 2: w2, 3: w3}


ACCELERATOR = "cuda" if torch.cuda.is_available() else "xpu" if hasattr(torch, "xpu") and torch.xpu.is_available() else None


@pytest.mark.parametrize("device", ["cpu", pytest.param(ACCELERATOR or "accelerator", marks=pytest.mark.skipif(
    ACCELERATOR is None, reason="no CUDA/ROCm/XPU device on this machine"))])
@pytest.mark.parametrize("spare", [False, True])
def test_first_apply_loads_everything_then_only_changes(versions, device, spare):
    paths, weights = versions
    module = build_model(CONFIG).to(device)
    engine = TorchModuleEngine(module, spare=spare)
    first = engine.switch(Target(paths[1], "1"), None)
    assert first.tensors_changed == len(weights[1])
    assert_module_holds(module, weights[1])
    second = engine.switch(Target(paths[2], "2"), Target(paths[1], "1"))
    assert second.tensors_changed == 2  # lm_head.weight and the logit_bias buffer
    assert_module_holds(module, weights[2])
    assert engine.served_version() == "2"
    assert all(t.device.type == device for t in module.state_dict().values())  # updated where it lives


def test_apply_into_a_module_that_already_matches_copies_nothing(versions):
    paths, weights = versions
    module = build_model(CONFIG)
    module.load_state_dict(weights[3])
    report = ModuleApplier(module).apply(paths[3])
    assert report.changed == 0 and report.unchanged == len(weights[3])


def test_digest_matches_manifest_digest(versions):
    paths, weights = versions
    from deltafs.engines.versions import read_version_manifest

    man = read_version_manifest(paths[2])
    digests = {s.tensor_name: s.digest for f in man.files for s in f.segments if s.kind == "tensor"}
    assert digests == {k: tensor_digest(v, digests[k], man.chunk_bytes) for k, v in weights[2].items()}


def test_corrupt_file_is_caught_after_apply_and_rolled_back(versions):
    paths, weights = versions
    module = build_model(CONFIG)
    engine = TorchModuleEngine(module)
    engine.switch(Target(paths[2], "2"), None)
    # Flip one byte of the embedding inside version 3's file: pull verified it, the disk changed since.
    path = f"{paths[3]}/model.safetensors"
    data = bytearray(open(path, "rb").read())
    header_len = 8 + int.from_bytes(data[:8], "little")
    start = header_len + json.loads(data[8:header_len])["model.embed_tokens.weight"]["data_offsets"][0]
    data[start] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(SwitchError, match="model.embed_tokens.weight") as info:
        engine.switch(Target(paths[3], "3"), Target(paths[2], "2"))
    assert info.value.rolled_back
    assert_module_holds(module, weights[2])
    assert engine.served_version() == "2"


def test_dtype_mismatch_is_refused_and_module_untouched(versions):
    paths, weights = versions
    module = build_model(CONFIG).float()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(SwitchError, match="never converts"):
        TorchModuleEngine(module).switch(Target(paths[1], "1"), None)
    assert_module_holds(module, before)


def test_missing_tensor_in_module_is_an_error_when_strict(versions):
    paths, _ = versions
    module = build_model(CONFIG)
    del module.logit_bias
    with pytest.raises(EngineError, match="logit_bias"):
        ModuleApplier(module).apply(paths[1])
    report = ModuleApplier(module, strict=False).apply(paths[1])
    assert report.skipped == ("logit_bias",)


def test_switch_waits_for_the_inference_lock(versions):
    paths, weights = versions
    module = build_model(CONFIG)
    lock = threading.Lock()
    engine = TorchModuleEngine(module, lock=lock)
    done = threading.Event()
    with lock:  # a forward pass in progress
        worker = threading.Thread(target=lambda: (engine.switch(Target(paths[1], "1"), None), done.set()))
        worker.start()
        time.sleep(0.2)
        assert not done.is_set()
    worker.join(5)
    assert done.is_set()
    assert_module_holds(module, weights[1])


def test_truncated_file_is_rolled_back(versions):
    paths, weights = versions
    module = build_model(CONFIG)
    engine = TorchModuleEngine(module)
    engine.switch(Target(paths[1], "1"), None)
    path = f"{paths[2]}/model.safetensors"
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    with pytest.raises(SwitchError) as info:
        engine.switch(Target(paths[2], "2"), Target(paths[1], "1"))
    assert info.value.rolled_back
    assert_module_holds(module, weights[1])


# --- sparse apply: bit-exact over dtypes, whole-copy fallback, device checksums, rollback ---------------------------

DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.float64, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool]


def mixed_tensors(seed: int) -> dict[str, torch.Tensor]:
    """layers.<i>.w: one tensor per dtype (DTYPES[i]) at awkward sizes (odd, under and over 1024 words), floats with NaN payloads and -0.0."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i, dtype in enumerate(DTYPES):
        shape = (37, 301) if i % 2 else (3 * 1024 + 5,)
        raw = torch.randint(0, 256, (torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size(),),
                            dtype=torch.uint8, generator=gen)
        if dtype == torch.bool:
            raw = raw & 1
        out[f"layers.{i}.w"] = raw.view(dtype).reshape(shape).clone()
    out["big.w"] = torch.randn(600_000, generator=gen).to(torch.bfloat16)  # scattered in several blocks on the CPU
    out["layers.0.w"].view(torch.int16)[:2] = torch.tensor([0x7FC1, -0x8000], dtype=torch.int16)  # NaN, -0.0
    return out


def changed(tensors: dict[str, torch.Tensor], fraction: float, seed: int, only: str | None = None
            ) -> dict[str, torch.Tensor]:
    """A copy with `fraction` of each tensor's elements (or only tensor `only`'s) given new random bit patterns."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        t = t.clone()
        if only in (None, name):
            raw = t.view(-1).view(torch.uint8 if t.dtype == torch.bool else t.dtype)
            pos = torch.randperm(raw.numel(), generator=gen)[: max(1, int(raw.numel() * fraction))]
            if t.dtype == torch.bool:
                raw[pos] ^= 1
            else:
                as_int = raw.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
                as_int[pos] = as_int[pos] ^ 0x5
        out[name] = t
    return out


def module_of(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module holding a zeroed buffer under each dotted name (buffers, so integer dtypes are allowed)."""
    root = torch.nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_buffer(leaf, torch.zeros_like(t))
    return root


@pytest.fixture()
def publish(tmp_path):
    """push + pull one version of a state dict; returns its verified version directory."""
    store, dest = str(tmp_path / "store"), str(tmp_path / "dest")
    made = []

    def _publish(tensors: dict[str, torch.Tensor]) -> str:
        push_tensors(store, tensors, cache_dir=str(tmp_path / "cache"))
        made.append(pull(store, dest, keep=20).path)
        return made[-1]

    return _publish


def test_device_checksum_equals_the_checksum_of_the_file_bytes():
    from deltafs.checksum import device_checksums, host_checksum

    tensors = list(mixed_tensors(3).values())
    for n in (0, 1, 3, 7, 1023 * 4 + 3):  # empty, under one word, tails of every length
        tensors += [torch.arange(n, dtype=torch.int16) * 977, torch.full((n,), -1, dtype=torch.int8)]
    tensors.append(torch.full((5000,), -(2**63), dtype=torch.int64))  # sums wrap modulo 2**64
    for t, got in zip(tensors, device_checksums(tensors), strict=True):
        assert got == host_checksum(t.contiguous().view(-1).view(torch.uint8).numpy(), t.element_size())


def test_checksum_changes_when_any_single_element_changes():
    from deltafs.checksum import device_checksums

    base = torch.randn(3 * 8192 + 3).to(torch.bfloat16)
    edits = []
    for pos in (0, 1, 3, 4, 8191, 8192, 20000, base.numel() - 1):  # first/last of words, rows and the tail
        t = base.clone()
        t.view(torch.int16)[pos] ^= 1 << (pos % 16)
        edits.append(t)
    sums = device_checksums([base] + edits)
    assert len(set(sums)) == len(sums)


@pytest.mark.parametrize("spare", [False, True])
def test_sparse_apply_is_bit_exact_over_dtypes(publish, spare):
    v1 = mixed_tensors(1)
    v2 = changed(v1, 0.02, seed=2)
    p1, p2 = publish(v1), publish(v2)
    module = module_of(v1)
    engine = TorchModuleEngine(module, spare=spare)
    engine.switch(Target(p1, "1"), None)
    assert_module_holds(module, v1)
    engine.switch(Target(p2, "2"), Target(p1, "1"))
    assert_module_holds(module, v2)
    report = engine.last_report
    assert report.sparse == len(v2) and report.whole == 0
    assert report.swapped == (len(v2) if spare else 0)
    differing = sum(int((a.view(-1).view(torch.uint8) != b.view(-1).view(torch.uint8)).sum()) if a.dtype == torch.bool
                    else int((a.view(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
                        a.element_size()]) != b.view(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                                                               8: torch.int64}[a.element_size()])).sum())
                    for a, b in zip(v1.values(), v2.values(), strict=True))
    assert report.elements == differing  # only the elements that changed were written
    engine.switch(Target(p1, "1"), Target(p2, "2"))  # and back: the diff works in either direction
    assert_module_holds(module, v1)
    assert engine.applier.verify() == []


def test_a_mostly_changed_tensor_is_copied_whole(publish):
    v1 = mixed_tensors(1)
    v2 = changed(v1, 0.8, seed=4, only="layers.1.w")
    p1, p2 = publish(v1), publish(v2)
    module = module_of(v1)
    engine = TorchModuleEngine(module)
    engine.switch(Target(p1, "1"), None)
    engine.switch(Target(p2, "2"), Target(p1, "1"))
    assert (engine.last_report.whole, engine.last_report.sparse, engine.last_report.unchanged) == (1, 0, len(v1) - 1)
    assert_module_holds(module, v2)


def test_without_the_previous_files_the_changed_tensors_are_copied_whole(publish):
    import shutil

    v1 = mixed_tensors(1)
    v2 = changed(v1, 0.02, seed=5)
    p1, p2 = publish(v1), publish(v2)
    module = module_of(v1)
    engine = TorchModuleEngine(module)
    engine.switch(Target(p1, "1"), None)
    shutil.rmtree(p1)  # the diff base is gone
    engine.switch(Target(p2, "2"), None)
    assert engine.last_report.whole == len(v2)
    assert_module_holds(module, v2)


@pytest.mark.parametrize("spare", [False, True])
def test_checksum_detects_a_corrupted_module_tensor_and_the_next_apply_repairs_it(publish, spare):
    v1 = mixed_tensors(1)
    v2 = changed(v1, 0.02, seed=6, only="layers.2.w")
    p1, p2 = publish(v1), publish(v2)
    module = module_of(v1)
    engine = TorchModuleEngine(module, spare=spare)
    engine.switch(Target(p1, "1"), None)
    assert engine.applier.verify() == []
    getattr(module.layers, "7").w.view(-1)[100] += 1  # something wrote into the live module
    getattr(module.layers, "2").w.view(-1)[0] = 0.5
    assert engine.applier.verify() == ["layers.2.w", "layers.7.w"]
    engine.switch(Target(p2, "2"), Target(p1, "1"))
    assert engine.last_report.repaired == ("layers.2.w", "layers.7.w")
    assert_module_holds(module, v2)  # the tensor v2 does not change is repaired too
    assert engine.applier.verify() == []


@pytest.mark.parametrize("gone", [False, True], ids=["previous-files-kept", "previous-files-gone"])
@pytest.mark.parametrize("spare", [False, True])
def test_a_failure_during_the_pause_undoes_the_scatter_and_rolls_back(publish, spare, gone):
    """An expanded buffer (stride 0) cannot be written whole: copy_ raises in the pause, after the scatters of the
    other tensors ran. The rollback must leave the module bit-exact on version 1.

    gone: the previous version's files were removed (a pull with keep=1, a cleanup), so every changed tensor is
    copied whole, and a pause that failed after some of those copies could not put them back: the module was left
    mixed (rolled_back False, a CRITICAL line). The engine now keeps their old bytes on the host for that case."""
    v1 = {**mixed_tensors(1), "shared.bias": torch.zeros(4)}
    v2 = {**changed(mixed_tensors(1), 0.02, seed=7), "shared.bias": torch.ones(4)}
    p1, p2 = publish(v1), publish(v2)
    module = module_of(mixed_tensors(1))
    module.add_module("shared", torch.nn.Module())
    module.shared.register_buffer("bias", torch.zeros(1).expand(4))
    engine = TorchModuleEngine(module, spare=spare)  # spare: the swaps ran before the failing copy
    engine.switch(Target(p1, "1"), None)
    assert_module_holds(module, v1)
    if gone:
        shutil.rmtree(p1)
    with pytest.raises(SwitchError) as info:
        engine.switch(Target(p2, "2"), Target(p1, "1"))
    assert info.value.rolled_back and engine.served_version() == "1"
    assert_module_holds(module, v1)
    assert engine.applier.verify() == []


def test_tied_tensors_with_different_bytes_are_refused_before_the_pause(publish):
    v1 = {"a.weight": torch.ones(8), "b.weight": torch.ones(8)}
    v2 = {"a.weight": torch.ones(8), "b.weight": torch.full((8,), 2.0)}
    p1, p2 = publish(v1), publish(v2)
    module = module_of({"a.weight": v1["a.weight"]})
    module.add_module("b", torch.nn.Module())
    module.b.register_buffer("weight", module.a.weight)
    engine = TorchModuleEngine(module)
    engine.switch(Target(p1, "1"), None)
    with pytest.raises(SwitchError, match="tied"):
        engine.switch(Target(p2, "2"), Target(p1, "1"))
    assert_module_holds(module, v1)
    assert engine.served_version() == "1"


@pytest.mark.parametrize("spare", [False, True])
def test_partly_overlapping_views_are_refused_before_the_pause(publish, spare):
    """b is a view of a[8:16]: one write changes the other, so no apply can give both their bytes. A switch to a
    version where they disagree (a[9] 100, b[1] 200) used to report success with a[9] wrong; every switch into such
    a module is refused at staging, and the module is untouched."""
    v1 = {"a": torch.arange(24.0), "b": torch.arange(8.0, 16.0)}
    v2 = {"a": v1["a"].clone(), "b": v1["b"].clone()}
    v2["a"][9] = 100.0
    v2["b"][1] = 200.0
    p1, p2 = publish(v1), publish(v2)
    module = torch.nn.Module()
    module.register_buffer("a", torch.zeros(24))
    module.register_buffer("b", module.a[8:16])
    engine = TorchModuleEngine(module, spare=spare)
    for target, previous in ((Target(p1, "1"), None), (Target(p2, "2"), Target(p1, "1"))):
        with pytest.raises(SwitchError, match="tensors a and b share part of their memory"):
            engine.switch(target, previous)
        assert not module.a.any() and engine.served_version() is None


def test_interleaved_views_of_one_buffer_are_not_overlaps(publish):
    """Column halves of one matrix (w[:, :4], w[:, 4:]) interleave in memory but share no element: applied."""
    w = torch.arange(32.0).reshape(4, 8)
    v1 = {"left": w[:, :4].clone(), "right": w[:, 4:].clone()}
    v2 = {"left": v1["left"] + 1, "right": v1["right"] - 1}
    p1, p2 = publish(v1), publish(v2)
    module = torch.nn.Module()
    storage = w.clone()
    module.register_buffer("left", storage[:, :4])
    module.register_buffer("right", storage[:, 4:])
    engine = TorchModuleEngine(module)
    engine.switch(Target(p1, "1"), None)
    engine.switch(Target(p2, "2"), Target(p1, "1"))
    assert torch.equal(storage, torch.cat([v2["left"], v2["right"]], dim=1))


@pytest.mark.parametrize("spare", [False, True])
def test_engine_stays_exact_over_a_run_of_versions(publish, spare):
    versions = [mixed_tensors(1)]
    for step, fraction in enumerate((0.02, 0.0, 0.3, 0.9, 0.005)):
        versions.append(changed(versions[-1], fraction, seed=10 + step) if fraction else dict(versions[-1]))
    paths = [publish(v) for v in versions]
    module = module_of(versions[0])
    engine = TorchModuleEngine(module, spare=spare)
    previous = None
    for n in [0, 1, 2, 3, 4, 5, 2, 5, 0]:  # forward, then jumps back and forth
        target = Target(paths[n], str(n))
        engine.switch(target, previous)
        assert_module_holds(module, versions[n])
        previous = target
    assert engine.applier.verify() == []


def test_a_version_that_fails_before_the_pause_leaves_the_module_untouched(versions):
    paths, weights = versions
    module = build_model(CONFIG)
    engine = TorchModuleEngine(module)
    engine.switch(Target(paths[1], "1"), None)
    path = f"{paths[2]}/model.safetensors"
    data = bytearray(open(path, "rb").read())
    header_len = 8 + int.from_bytes(data[:8], "little")
    data[header_len + json.loads(data[8:header_len])["lm_head.weight"]["data_offsets"][1] - 1] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(SwitchError, match="changed since it was pulled") as info:
        engine.switch(Target(paths[2], "2"), None)
    assert not info.value.rolled_back  # no previous named, and none needed: the module was never touched
    assert engine.served_version() == "1"
    assert_module_holds(module, weights[1])
    assert engine.applier.verify() == []


def test_a_version_staged_before_another_apply_is_refused(versions):
    paths, weights = versions
    module = build_model(CONFIG)
    applier = ModuleApplier(module)
    applier.apply(paths[1])
    stale = applier.stage(paths[3])  # diffed against version 1
    applier.apply(paths[2])
    with pytest.raises(EngineError, match="stage it again"):
        applier.commit(stale)
    assert_module_holds(module, weights[2])
    applier.commit(applier.stage(paths[3]))
    assert_module_holds(module, weights[3])


def test_spare_mode_swaps_what_tensors_point_at_and_keeps_the_objects(publish):
    v1 = mixed_tensors(1)
    v2 = changed(v1, 0.02, seed=20)
    p1, p2 = publish(v1), publish(v2)
    module = module_of(v1)
    engine = TorchModuleEngine(module, spare=True)
    engine.switch(Target(p1, "1"), None)
    objects = {name: module.get_buffer(name) for name in v1}
    pointers = {name: t.data_ptr() for name, t in objects.items()}
    engine.switch(Target(p2, "2"), Target(p1, "1"))
    assert all(module.get_buffer(name) is t for name, t in objects.items())  # the module's tensors are the same objects
    assert all(t.data_ptr() != pointers[name] for name, t in objects.items())  # pointing at the spare buffers
    assert_module_holds(module, v2)
    engine.switch(Target(p1, "1"), Target(p2, "2"))  # back: the buffers of version 1 are written again and swapped in
    assert all(t.data_ptr() == pointers[name] for name, t in objects.items())
    assert_module_holds(module, v1)
    assert engine.applier.verify() == []


def test_spare_mode_keeps_tied_tensors_tied_and_updates_shared_views_in_place(publish):
    base = torch.randn(64)
    v1 = {"a.weight": base, "b.weight": base.clone(), "flat.x": torch.arange(8.0), "flat.y": torch.arange(8.0) + 8}
    v2 = {k: t + 1 for k, t in v1.items()}
    v2["b.weight"] = v2["a.weight"].clone()
    p1, p2 = publish(v1), publish(v2)
    module = module_of({"a.weight": base})
    module.add_module("b", torch.nn.Module())
    module.b.register_buffer("weight", module.a.weight)  # one tensor object under two names
    storage = torch.zeros(16)
    module.add_module("flat", torch.nn.Module())
    module.flat.register_buffer("x", storage[:8])  # views into one buffer: a swap would cut them off from it
    module.flat.register_buffer("y", storage[8:])
    engine = TorchModuleEngine(module, spare=True)
    engine.switch(Target(p1, "1"), None)
    engine.switch(Target(p2, "2"), Target(p1, "1"))
    assert module.a.weight is module.b.weight
    assert_module_holds(module, v2)
    assert torch.equal(storage, torch.cat([v2["flat.x"], v2["flat.y"]]))  # written in place, through the views
    assert engine.last_report.swapped == 1


@pytest.mark.parametrize("spare", [False, True])
def test_module_tensors_the_checkpoint_does_not_name_keep_sharing_memory_with_the_ones_it_does(publish, spare):
    """HF ties weights as lm_head.weight = Parameter(embed.weight): another object over the same memory, and the
    checkpoint holds the embedding only; a buffer may be a view of a parameter (q = qkv[:4]). In spare mode the
    named tensor was swapped and the other kept the old buffer: stale after every other switch, then overwritten
    as the next spare, while verify() saw nothing. They are updated in place now, as in the default mode."""
    weights = [{"embed.weight": torch.full((16, 8), float(k)), "qkv.weight": torch.full((12,), float(10 * k))}
               for k in (1, 2, 3, 4)]
    paths = [publish(w) for w in weights]
    module = torch.nn.Module()
    module.embed = torch.nn.Embedding(16, 8)
    module.lm_head = torch.nn.Linear(8, 16, bias=False)
    module.lm_head.weight = torch.nn.Parameter(module.embed.weight)
    module.qkv = torch.nn.Module()
    module.qkv.weight = torch.nn.Parameter(torch.zeros(12))
    module.register_buffer("q", module.qkv.weight.detach()[:4], persistent=False)
    engine = TorchModuleEngine(module, spare=spare)
    previous = None
    for n, (path, w) in enumerate(zip(paths, weights, strict=True), 1):
        engine.switch(Target(path, str(n)), previous)
        previous = Target(path, str(n))
        assert torch.equal(module.lm_head.weight, w["embed.weight"]) and torch.equal(module.embed.weight, w["embed.weight"])
        assert module.lm_head.weight.data_ptr() == module.embed.weight.data_ptr()
        assert torch.equal(module.q, w["qkv.weight"][:4]) and module.q.data_ptr() == module.qkv.weight.data_ptr()
        assert engine.applier.verify() == []


def test_spare_mode_refuses_a_version_whose_spares_a_later_staging_overwrote(versions):
    paths, weights = versions
    module = build_model(CONFIG)
    applier = ModuleApplier(module, spare=True)
    applier.apply(paths[1])
    first = applier.stage(paths[2])
    applier.stage(paths[3])  # writes the same spare buffers; never committed
    with pytest.raises(EngineError, match="stage it again"):
        applier.commit(first)
    assert_module_holds(module, weights[1])
    applier.commit(applier.stage(paths[2]))
    assert_module_holds(module, weights[2])


def test_a_failed_staging_puts_the_previous_version_back_under_the_lock(versions):
    """A staging that fails leaves the module alone; when the module was not on the previous version (a fresh
    engine, an earlier failed rollback), the engine applies previous. It did so without the lock, under a forward
    pass."""
    paths, weights = versions
    module = build_model(CONFIG)
    lock = threading.Lock()
    engine = TorchModuleEngine(module, lock=lock)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    errors: list[BaseException] = []

    def switch() -> None:
        try:
            engine.switch(Target(str(paths[2]) + "-missing", "2"), Target(paths[1], "1"))
        except SwitchError as exc:
            errors.append(exc)

    staged: list[str] = []
    real_stage = engine.applier.stage

    def stage(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        got = real_stage(path, *args, **kwargs)
        staged.append(str(path))
        return got

    engine.applier.stage = stage  # type: ignore[method-assign]
    with lock:  # a forward pass
        worker = threading.Thread(target=switch)
        worker.start()
        deadline = time.monotonic() + 60
        while not staged and time.monotonic() < deadline:
            time.sleep(0.02)
        worker.join(0.2)
        assert worker.is_alive()  # waits for the pass
        assert_module_holds(module, before)
        assert staged == [str(paths[1])]  # ... but staged version 1 meanwhile: only the commit waits for the lock
    worker.join(30)
    assert len(errors) == 1 and errors[0].rolled_back
    assert_module_holds(module, weights[1])
    assert engine.served_version() == "1"


def test_spare_mode_stagings_from_two_threads_do_not_interleave(versions, monkeypatch):
    """Two switches at once: a staging that ran while another wrote the spares gave the other its number (read at
    the end), so committing the first swapped in the second's bytes under the first's version. Stagings and commits
    of a spare-mode applier now take turns, and each staging keeps its own number."""
    import deltafs.engines.torch_module as tm

    paths, weights = versions
    module = build_model(CONFIG)
    applier = ModuleApplier(module, spare=True)
    applier.apply(paths[1])
    real = tm.device_checksums
    other: dict[str, object] = {}
    inside = threading.Event()

    def stage_other() -> None:
        other["staged"] = applier.stage(paths[3])

    def sums(tensors):  # type: ignore[no-untyped-def]
        if threading.current_thread().name == "first" and not inside.is_set():
            inside.set()
            worker = threading.Thread(target=stage_other, name="second")
            worker.start()
            worker.join(0.5)
            other["finished inside the first"] = not worker.is_alive()
            other["worker"] = worker
        return real(tensors)

    monkeypatch.setattr(tm, "device_checksums", sums)
    first: dict[str, object] = {}
    thread = threading.Thread(target=lambda: first.update(staged=applier.stage(paths[2])), name="first")
    thread.start()
    thread.join(30)
    other["worker"].join(30)  # type: ignore[attr-defined]
    assert other["finished inside the first"] is False
    with pytest.raises(EngineError, match="stage it again"):
        applier.commit(first["staged"])  # type: ignore[arg-type]
    applier.commit(other["staged"])  # type: ignore[arg-type]
    assert_module_holds(module, weights[3])
    assert applier.verify() == []


@pytest.mark.parametrize("spare", [False, True])
def test_switches_made_inside_inference_mode(publish, spare):
    """A serving loop usually runs under torch.inference_mode(), switches included. In place, every switch used to
    fail (the engine's buffers became inference tensors, which its scatter threads cannot write) and roll back;
    with spares, inference tensors were swapped into the module (no backward through it, no later update outside
    the mode). The applier now works in the module's own mode."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])  # enough blocks for the scatter pool
    v1 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    v2 = changed(v1, 0.02, seed=3)
    v3 = changed(v2, 0.02, seed=4)
    weights = [v1, v2, v3]
    paths = [publish(v) for v in weights]
    engine = TorchModuleEngine(model, spare=spare)
    previous = None
    with torch.inference_mode():
        for n in (0, 1, 2, 1):
            target = Target(paths[n], str(n))
            engine.switch(target, previous)
            previous = target
            assert_module_holds(model, weights[n])
    assert not any(t.is_inference() for t in model.state_dict().values())
    model(torch.randn(2, 256)).sum().backward()  # the parameters still train
    engine.switch(Target(paths[2], "2"), previous)  # and a switch outside the mode works
    assert_module_holds(model, v3)
    assert engine.applier.verify() == []


def test_a_version_holding_none_of_the_modules_tensors_is_refused(tmp_path):
    """An empty or wrong-rank state dict pushed by mistake used to switch "successfully": the module kept its
    weights, served under the new version's name. Refused before the pause; the module stays on its version."""
    store, dest = str(tmp_path / "store"), str(tmp_path / "dest")
    model = torch.nn.Linear(8, 8)
    v1 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    push_tensors(store, v1, cache_dir=str(tmp_path / "cache"))
    p1 = pull(store, dest, keep=5).path
    push_tensors(store, {"other.weight": torch.ones(3)}, cache_dir=str(tmp_path / "cache"))
    p2 = pull(store, dest, keep=5).path
    engine = TorchModuleEngine(model, strict=False)
    engine.switch(Target(p1, "1"), None)
    with pytest.raises(SwitchError, match="holds none of the module's tensors"):
        engine.switch(Target(p2, "2"), Target(p1, "1"))
    assert engine.served_version() == "1"
    assert_module_holds(model, v1)


def test_a_module_on_the_meta_device_is_refused_with_what_to_do(tmp_path):
    """A module built on the meta device (no storage) was refused as "tied" (every meta tensor has address 0)."""
    store, dest = str(tmp_path / "store"), str(tmp_path / "dest")
    v1 = {k: v.detach().clone() for k, v in torch.nn.Linear(8, 8).state_dict().items()}
    push_tensors(store, v1, cache_dir=str(tmp_path / "cache"))
    path = pull(store, dest).path
    with torch.device("meta"):
        model = torch.nn.Linear(8, 8)
    engine = TorchModuleEngine(model)
    with pytest.raises(SwitchError, match=r"on the meta device, which holds no bytes: materialize the module first"):
        engine.switch(Target(path, "1"), None)
    model.to_empty(device="cpu")
    engine.switch(Target(path, "1"), None)
    assert_module_holds(model, v1)


def test_the_overlap_check_agrees_with_a_byte_by_byte_comparison():
    """_first_shared_byte (one sort over every element) against sets of bytes, on random strided, expanded and
    re-typed views of one buffer."""
    import random

    from deltafs.engines.torch_module import _first_shared_byte, _layout_key

    rng = random.Random(5)
    base = torch.zeros(4096, dtype=torch.uint8)
    for _ in range(300):
        views = []
        for k in range(rng.randint(2, 4)):
            dtype = rng.choice([torch.uint8, torch.int16, torch.float32])
            item = torch.tensor([], dtype=dtype).element_size()
            typed = base[rng.randrange(0, 64) * 4:].view(dtype) if item > 1 else base[rng.randrange(0, 256):]
            shape = (rng.randint(1, 6), rng.randint(1, 6))
            stride = (rng.randint(0, 12), rng.randint(0, 3))
            views.append((f"t{k}", typed.as_strided(shape, stride)))

        def bytes_of(t: torch.Tensor) -> set[int]:
            item = t.element_size()
            starts = {t.data_ptr() + item * sum(i * st for i, st in zip(idx, t.stride(), strict=True))
                      for idx in np.ndindex(*t.shape)}
            return {b + j for b in starts for j in range(item)}

        layouts = {}
        for name, t in views:
            layouts.setdefault(_layout_key(t), (name, t))
        distinct = list(layouts.values())
        expected = any(bytes_of(a) & bytes_of(b) for i, (_, a) in enumerate(distinct) for _, b in distinct[i + 1:])
        assert (_first_shared_byte(views) is not None) == expected, views


def test_a_view_of_another_shape_over_the_same_bytes_is_a_tie(publish):
    """w and w.view(-1) hold the same bytes in the same order: tied (their digests must agree), not an overlap."""
    v1 = {"w": torch.arange(12.0).reshape(3, 4), "flat": torch.arange(12.0)}
    v2 = {"w": v1["w"] + 1, "flat": v1["flat"] + 1}
    p1, p2 = publish(v1), publish(v2)
    module = torch.nn.Module()
    module.register_buffer("w", torch.zeros(3, 4))
    module.register_buffer("flat", module.w.view(-1))
    engine = TorchModuleEngine(module)
    engine.switch(Target(p1, "1"), None)
    engine.switch(Target(p2, "2"), Target(p1, "1"))
    assert torch.equal(module.w, v2["w"]) and engine.applier.verify() == []
