"""In-place apply into a live torch.nn.Module: bit-exact, only changed tensors, verified, rolled back on failure."""

from __future__ import annotations

import json
import threading
import time

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
        assert torch.equal(live[name].cpu().view(torch.uint8), t.view(torch.uint8)), name


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
def test_first_apply_loads_everything_then_only_changes(versions, device):
    paths, weights = versions
    module = build_model(CONFIG).to(device)
    engine = TorchModuleEngine(module)
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
    assert digests == {k: tensor_digest(v) for k, v in weights[2].items()}


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
