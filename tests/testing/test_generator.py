"""The trainer simulator produces realistic, deterministic bf16 versions and loadable HF checkpoint directories."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deltafs.testing.generator import LLAMA_1B, SMALL, TINY, TrainerSim, changed_fraction, write_checkpoint


def test_tiny_has_llm_shapes_and_is_small() -> None:
    shapes = TINY.shapes()
    h = TINY.hidden_size
    assert shapes["model.embed_tokens.weight"] == (TINY.vocab_size, h)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (TINY.num_heads * TINY.head_dim, h)
    # GQA: k and v have fewer heads than q.
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (TINY.num_kv_heads * TINY.head_dim, h)
    assert shapes["model.layers.1.mlp.down_proj.weight"] == (h, TINY.intermediate_size)
    assert shapes["model.norm.weight"] == (h,)
    assert "lm_head.weight" in shapes
    assert 100_000 < TINY.num_params() * 2 < 1_000_000


def test_1b_config_is_about_one_billion_parameters() -> None:
    assert 1.1e9 < LLAMA_1B.num_params() < 1.3e9
    assert "lm_head.weight" not in LLAMA_1B.shapes()  # tied, as in Llama-3.2-1B
    assert LLAMA_1B.with_layers(2).num_params() < LLAMA_1B.num_params()


def test_steps_are_deterministic_per_seed() -> None:
    a, b, c = TrainerSim(TINY, seed=3), TrainerSim(TINY, seed=3), TrainerSim(TINY, seed=4)
    sa, sb, sc = a.step(), b.step(), c.step()
    assert all(torch.equal(sa[k].view(torch.int16), sb[k].view(torch.int16)) for k in sa)
    assert not all(torch.equal(sa[k].view(torch.int16), sc[k].view(torch.int16)) for k in sa)
    assert all(t.dtype == torch.bfloat16 and tuple(t.shape) == TINY.shapes()[k] for k, t in sa.items())


@pytest.mark.parametrize(("lr", "low", "high"), [(3e-7, 0.002, 0.01), (1.5e-6, 0.01, 0.04)])
def test_changed_fraction_follows_learning_rate(lr: float, low: float, high: float) -> None:
    sim = TrainerSim(SMALL, seed=0, lr=lr)
    prev = sim.export()
    for _ in range(3):
        new = sim.step()
        assert low < changed_fraction(prev, new) < high
        prev = new


def test_changes_are_mostly_one_ulp() -> None:
    sim = TrainerSim(TINY, seed=0, lr=1e-6)
    prev, new = sim.export(), sim.step()
    diffs = torch.cat([(new[k].view(torch.int16).int() - prev[k].view(torch.int16).int()).flatten() for k in new])
    moved = diffs[diffs != 0]
    assert moved.numel() > 0
    assert (moved.abs() == 1).float().mean() > 0.8


def test_write_single_file_checkpoint(tmp_path: Path) -> None:
    sim = TrainerSim(TINY, seed=0)
    tensors = sim.step()
    written = write_checkpoint(tmp_path, tensors, TINY, step=1)
    assert "model.safetensors" in written and "model.safetensors.index.json" not in written
    loaded = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert set(loaded) == set(tensors)
    assert all(torch.equal(loaded[k].view(torch.int16), tensors[k].view(torch.int16)) for k in tensors)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == TINY.num_layers and cfg["model_type"] == "llama"
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.getsize(os.path.join(tmp_path, name)) > 0


def test_write_sharded_checkpoint(tmp_path: Path) -> None:
    tensors = TrainerSim(TINY, seed=0).export()
    written = write_checkpoint(tmp_path, tensors, TINY, shard_bytes=100_000)
    shards = [w for w in written if w.endswith(".safetensors")]
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    total = 0
    for shard in shards:
        part = load_file(os.path.join(tmp_path, shard))
        for name, t in part.items():
            assert index["weight_map"][name] == shard
            assert torch.equal(t.view(torch.int16), tensors[name].view(torch.int16))
            total += t.numel() * 2
    assert index["metadata"]["total_size"] == total


def test_simulating_a_subset_of_tensors() -> None:
    names = ["model.layers.1.mlp.up_proj.weight", "model.embed_tokens.weight"]
    sim = TrainerSim(TINY, seed=0, names=names)
    out = sim.step()
    assert list(out) == ["model.embed_tokens.weight", "model.layers.1.mlp.up_proj.weight"]  # checkpoint order
    with pytest.raises(KeyError):
        TrainerSim(TINY, names=["model.layers.9.mlp.up_proj.weight"])
