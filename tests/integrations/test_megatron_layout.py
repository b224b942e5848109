"""The Megatron → HF layout rules on plain tensors (no megatron-core needed).

Shards are cut from known HF tensors the way megatron-core lays them out, and merging must give the
HF tensors back bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from deltafs.errors import UsageError
from deltafs.integrations.megatron_gather import check_plan
from deltafs.integrations.megatron_layout import (
    Arch, MegatronLayoutError, check_complete, convert_shards, expected_hf_shapes, merge_tp)

ARCH = Arch(num_layers=2, hidden_size=8, ffn_hidden_size=12, num_heads=4, num_query_groups=2, head_dim=4,
            vocab_size=10, padded_vocab_size=16, tied_embeddings=False, qkv_bias=True, qk_norm=False)
L = "decoder.layers.1."


def hf_tensors(arch: Arch = ARCH) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g) for n, s in expected_hf_shapes(arch).items()}


def fused_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: Arch) -> torch.Tensor:
    """Megatron's linear_qkv rows: for each query group, its q heads, then its k head, then its v head."""
    g, d = arch.num_query_groups, arch.head_dim
    rest = q.shape[1:]
    return torch.cat([q.reshape(g, -1, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1).reshape(-1, *rest)


def fc1_shards(gate: torch.Tensor, up: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """Megatron's linear_fc1 on TP rank r: [gate_r; up_r]."""
    return [torch.cat([gr, ur]) for gr, ur in zip(gate.chunk(tp), up.chunk(tp), strict=True)]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_shards_merge_back_to_the_hf_tensors(tp: int) -> None:
    hf = hf_tensors()
    p = "model.layers.1."
    q, k, v = (hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
    got = merge_tp(L + "self_attention.linear_qkv.weight", fused_qkv(q, k, v, ARCH).chunk(tp), ARCH)
    assert all(torch.equal(got[p + f"self_attn.{x}_proj.weight"], hf[p + f"self_attn.{x}_proj.weight"]) for x in "qkv")
    qb, kb, vb = (hf[p + f"self_attn.{x}_proj.bias"] for x in "qkv")
    got = merge_tp(L + "self_attention.linear_qkv.bias", fused_qkv(qb, kb, vb, ARCH).chunk(tp), ARCH)
    assert torch.equal(got[p + "self_attn.k_proj.bias"], kb) and torch.equal(got[p + "self_attn.v_proj.bias"], vb)

    gate, up = hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]
    got = merge_tp(L + "mlp.linear_fc1.weight", fc1_shards(gate, up, tp), ARCH)
    assert torch.equal(got[p + "mlp.gate_proj.weight"], gate) and torch.equal(got[p + "mlp.up_proj.weight"], up)

    down = hf[p + "mlp.down_proj.weight"]
    assert torch.equal(merge_tp(L + "mlp.linear_fc2.weight", down.chunk(tp, dim=1), ARCH)[p + "mlp.down_proj.weight"], down)
    o = hf[p + "self_attn.o_proj.weight"]
    got = merge_tp(L + "self_attention.linear_proj.weight", o.chunk(tp, dim=1), ARCH)
    assert torch.equal(got[p + "self_attn.o_proj.weight"], o)


def test_naive_concatenation_of_fc1_shards_would_be_wrong() -> None:
    """Why GLU shards need their own rule: cat + chunk(2) mixes gate and up rows at TP>1."""
    hf = hf_tensors()
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    naive_gate = torch.cat(fc1_shards(gate, up, 2)).chunk(2)[0]
    assert not torch.equal(naive_gate, gate)


def test_vocab_padding_is_cut_and_embeddings_merge_over_vocab() -> None:
    full = torch.randn(16, 8)
    got = merge_tp("embedding.word_embeddings.weight", full.chunk(2), ARCH)
    assert torch.equal(got["model.embed_tokens.weight"], full[:10])
    tied = Arch(**{**ARCH.__dict__, "tied_embeddings": True})
    assert merge_tp("output_layer.weight", full.chunk(2), tied) == {}


def test_transformer_engine_names_and_extra_state() -> None:
    """TE specs fuse the pre-norms into linear_qkv / linear_fc1; `_extra_state` entries are not weights."""
    arch = Arch(**{**ARCH.__dict__, "num_layers": 1, "qkv_bias": False})
    hf = hf_tensors(arch)
    p = "model.layers.0."
    sd = {
        "embedding.word_embeddings.weight": torch.cat([hf["model.embed_tokens.weight"], torch.zeros(6, 8)]),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
        "output_layer.weight": torch.cat([hf["lm_head.weight"], torch.zeros(6, 8)]),
        "output_layer._extra_state": None,
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": hf[p + "input_layernorm.weight"],
        "decoder.layers.0.self_attention.linear_qkv.weight": fused_qkv(
            *(hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv"), arch),
        "decoder.layers.0.self_attention.linear_qkv._extra_state": torch.tensor([1, 2], dtype=torch.uint8),
        "decoder.layers.0.self_attention.linear_proj.weight": hf[p + "self_attn.o_proj.weight"],
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight": hf[p + "post_attention_layernorm.weight"],
        "decoder.layers.0.mlp.linear_fc1.weight": fc1_shards(hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"], 1)[0],
        "decoder.layers.0.mlp.linear_fc2.weight": hf[p + "mlp.down_proj.weight"],
    }
    got = convert_shards([sd], arch)
    check_complete(got, arch)
    assert all(torch.equal(got[n], hf[n]) for n in hf)


def test_wrong_shard_shapes_and_unknown_parameters_are_refused() -> None:
    with pytest.raises(MegatronLayoutError, match="on TP rank 1 has shape"):
        merge_tp(L + "mlp.linear_fc2.weight", [torch.zeros(8, 6), torch.zeros(8, 5)], ARCH)
    with pytest.raises(MegatronLayoutError, match="not part of a Llama/Qwen-family"):
        merge_tp(L + "mlp.router.weight", [torch.zeros(4, 8)], ARCH)
    with pytest.raises(UsageError, match="vocab_size 20"):
        Arch(**{**ARCH.__dict__, "vocab_size": 20})


def _meta(arch: Arch, tp: int, pp: int, layers_of: list[list[int]]) -> list:
    """What each rank would report to check_plan for a well-formed model."""
    from deltafs.integrations.megatron_layout import expected_shard_shape

    out = []
    for pp_rank in range(pp):
        names = [f"decoder.layers.{n}.{s}" for n in layers_of[pp_rank] for s in (
            "input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
            "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight",
            "mlp.linear_fc2.weight")]
        if pp_rank == 0:
            names.append("embedding.word_embeddings.weight")
        if pp_rank == pp - 1:
            names += ["decoder.final_layernorm.weight", "output_layer.weight"]
        for tp_rank in range(tp):
            out.append((tp_rank, pp_rank, {n: (expected_shard_shape(n, arch, tp), "torch.float32") for n in names}))
    return out


def test_plan_checks_shapes_ownership_and_completeness() -> None:
    good = _meta(ARCH, 2, 2, [[0], [1]])
    plan = check_plan(good, ARCH, tp=2, pp=2)
    assert [name for name, _, _ in plan.stage(1)][0] == "decoder.final_layernorm.weight"

    bad = _meta(ARCH, 2, 2, [[0], [1]])
    bad[1][2][L.replace("1", "0") + "mlp.linear_fc1.weight"] = ((10, 8), "torch.float32")
    with pytest.raises(MegatronLayoutError, match=r"linear_fc1.weight on TP rank 1 of pipeline stage 0 has shape \(10, 8\)"):
        check_plan(bad, ARCH, tp=2, pp=2)

    with pytest.raises(MegatronLayoutError, match="held by pipeline stage 0 and by stage 1"):
        check_plan(_meta(ARCH, 1, 2, [[0, 1], [1]]), ARCH, tp=1, pp=2)
    with pytest.raises(MegatronLayoutError, match="no pipeline stage holds"):
        check_plan(_meta(ARCH, 1, 2, [[0], []]), ARCH, tp=1, pp=2)

    missing = _meta(ARCH, 2, 1, [[0, 1]])
    del missing[1][2]["decoder.layers.0.input_layernorm.weight"]
    with pytest.raises(MegatronLayoutError, match="TP rank 1 holds other parameters"):
        check_plan(missing, ARCH, tp=2, pp=1)

    mixed = _meta(ARCH, 2, 1, [[0, 1]])
    mixed[1][2]["decoder.layers.0.mlp.linear_fc2.weight"] = ((8, 6), "torch.bfloat16")
    with pytest.raises(MegatronLayoutError, match="different dtypes"):
        check_plan(mixed, ARCH, tp=2, pp=1)
