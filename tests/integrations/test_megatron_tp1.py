"""Megatron-core → HF at TP=1 in this process: logits of the published checkpoint match Megatron's."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("megatron_tp1")]

import hf_reference  # noqa: E402
import megatron_cpu as mc  # noqa: E402

from deltafs.publish import write_hf_checkpoint  # noqa: E402

VARIANTS = {
    # name: (tiny model, expected HF model_type)
    "llama-gqa-untied": (mc.Tiny(), "llama"),
    "llama-tied": (mc.Tiny(tied=True), "llama"),
    "qwen2-qkv-bias": (mc.Tiny(qkv_bias=True, tied=True), "qwen2"),
    "qwen3-qk-norm-mha": (mc.Tiny(qk_norm=True, groups=4, head_dim=24), "qwen3"),
    "llama3-rope-scaling-mqa": (mc.Tiny(groups=1, rope_scaling=True, rope_theta=500000.0), "llama"),
}


def _megatron() -> Any:
    from deltafs.integrations import megatron

    return megatron


def _publish_locally(model: Any, tiny: mc.Tiny, out: str, **kw: Any) -> dict[str, torch.Tensor]:
    dm = _megatron()
    info = dm.describe(model, vocab_size=tiny.vocab)
    tensors = dm.megatron_to_hf(model, info=info)
    assert tensors is not None
    cfg = dm.hf_config(info, **kw)
    write_hf_checkpoint(tensors, out, extra_files={"config.json": json.dumps(cfg).encode()})
    return tensors


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_converted_checkpoint_reproduces_megatron_logits(variant: str, tmp_path: Any) -> None:
    tiny, model_type = VARIANTS[variant]
    model = mc.build(tiny)
    toks = mc.tokens()
    mc.train_step(model, toks)  # norms and biases move away from their 1/0 initial values
    with torch.no_grad():
        want = mc.forward(model, toks)
    tensors = _publish_locally(model, tiny, str(tmp_path))

    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == model_type
    assert cfg["vocab_size"] == tiny.vocab and cfg["tie_word_embeddings"] == tiny.tied
    assert cfg["num_key_value_heads"] == tiny.groups and cfg["head_dim"] == tiny.head_dim
    assert ("lm_head.weight" in tensors) == (not tiny.tied)
    assert tensors["model.embed_tokens.weight"].shape == (tiny.vocab, tiny.hidden)  # padding rows cut
    assert not any("extra_state" in n for n in tensors)
    assert ("model.layers.0.self_attn.q_proj.bias" in tensors) == tiny.qkv_bias
    assert ("model.layers.2.self_attn.k_norm.weight" in tensors) == tiny.qk_norm
    assert (cfg["rope_scaling"] is not None) == tiny.rope_scaling

    got = hf_reference.logits(str(tmp_path), toks)
    assert got.shape == (*toks.shape, tiny.vocab)
    torch.testing.assert_close(got, want[..., : tiny.vocab].float(), rtol=1e-4, atol=1e-4)


def test_a_wrong_layout_is_caught_by_the_logits_check(tmp_path: Any) -> None:
    """The logits comparison is sharp enough to see a swapped gate/up or k/v."""
    tiny = mc.Tiny()
    model = mc.build(tiny)
    toks = mc.tokens()
    with torch.no_grad():
        want = mc.forward(model, toks)[..., : tiny.vocab]
    tensors = _publish_locally(model, tiny, str(tmp_path))
    for a, b in (("mlp.gate_proj", "mlp.up_proj"), ("self_attn.k_proj", "self_attn.v_proj")):
        bad = dict(tensors)
        pa, pb = f"model.layers.1.{a}.weight", f"model.layers.1.{b}.weight"
        bad[pa], bad[pb] = tensors[pb], tensors[pa]
        out = tmp_path / a
        write_hf_checkpoint(bad, str(out), extra_files={"config.json": (tmp_path / "config.json").read_bytes()})
        assert (hf_reference.logits(str(out), toks) - want).abs().max() > 1e-2


def test_bf16_model_in_its_training_wrapper_publishes_bf16(tmp_path: Any) -> None:
    from megatron.core.transformer.module import Float16Module

    tiny = mc.Tiny(dtype=torch.bfloat16)
    inner = mc.build(tiny, bf16=True)
    model = Float16Module(inner.config, inner)  # what Megatron trainers hand around; deltafs unwraps it
    tensors = _publish_locally(model, tiny, str(tmp_path))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("with_baseline", [False, True])
def test_push_step_push_then_pull_each_version(tmp_path: Any, with_baseline: bool, monkeypatch: Any) -> None:
    """The trainer loop: push, one optimizer step, push again; each pulled version has Megatron's logits.

    with_baseline: through a DeviceBaseline, with the CPU tensors taken as an accelerator's (DeviceBytes; this
    machine has none) and every range diffed however small."""
    from deltafs.publish import DeviceBaseline
    from deltafs.publish import hf as hf_mod
    from deltafs.read.pull import pull

    baseline = None
    if with_baseline:
        monkeypatch.setattr(hf_mod, "tensor_bytes",
                            lambda t, b=None, name="": hf_mod.DeviceBytes(t.detach().contiguous(), b, name))
        baseline = DeviceBaseline(min_range=1)
    dm = _megatron()
    tiny = mc.Tiny(qkv_bias=True)
    model = mc.build(tiny)
    toks = mc.tokens()
    store = str(tmp_path / "store")
    base = {"model_type": "qwen2", "vocab_size": tiny.vocab, "bos_token_id": 1, "eos_token_id": 2,
            "max_position_embeddings": 4096}
    logits = []
    for step in range(2):
        if step:
            mc.train_step(model, toks)
        with torch.no_grad():
            logits.append(mc.forward(model, toks)[..., : tiny.vocab].float())
        res = dm.push_megatron(model, store, config=base, metadata={"step": step},
                               cache_dir=str(tmp_path / "cache"), device_baseline=baseline)
        assert res.version == step + 1
        if baseline is not None:
            assert baseline.armed and baseline.last.mismatches == 0
            assert (baseline.last.ranges_diffed > 0) == (step > 0)
    assert res.kind != "full" and res.bytes_written < res.full_bytes  # the second version is a delta

    for version, want in ((1, logits[0]), (2, logits[1])):
        pulled = pull(store, str(tmp_path / "dest"), version=version)
        cfg = json.loads(open(os.path.join(pulled.path, "config.json")).read())
        assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["max_position_embeddings"]) == (1, 2, 4096)
        torch.testing.assert_close(hf_reference.logits(pulled.path, toks), want, rtol=1e-4, atol=1e-4)
    assert (logits[0] - logits[1]).abs().max() > 1e-3  # the step changed the model


@pytest.mark.parametrize("overrides, phrase", [
    ({"normalization": "LayerNorm"}, "normalization='LayerNorm'"),
    ({"gated_linear_unit": False, "activation_func": torch.nn.functional.gelu}, "SwiGLU"),
    ({"add_bias_linear": True}, "add_bias_linear"),
    ({"num_moe_experts": 4, "moe_ffn_hidden_size": 32, "moe_router_topk": 2}, "mixture of experts"),
])
def test_unsupported_models_are_refused_before_anything_is_written(overrides: dict[str, Any], phrase: str,
                                                                   tmp_path: Any) -> None:
    dm = _megatron()
    model = mc.build(mc.Tiny(), **overrides)
    store = tmp_path / "store"
    with pytest.raises(dm.UnsupportedModelError, match="Llama/Qwen-family") as err:
        dm.push_megatron(model, str(store), cache_dir=str(tmp_path / "cache"))
    assert phrase in str(err.value)
    assert not store.exists()


def test_given_hf_config_must_describe_the_model(tmp_path: Any) -> None:
    from deltafs.errors import UsageError

    dm = _megatron()
    model = mc.build(mc.Tiny())
    store = tmp_path / "store"
    with pytest.raises(UsageError, match="num_hidden_layers: config says 32, model has 3"):
        dm.push_megatron(model, str(store), config={"model_type": "llama", "num_hidden_layers": 32})
    with pytest.raises(dm.UnsupportedModelError, match="qwen3 expects"):
        dm.push_megatron(model, str(store), hf_arch="qwen3")
    with pytest.raises(UsageError, match="vocab_size 300"):
        dm.push_megatron(model, str(store), vocab_size=300)
    assert not store.exists()
