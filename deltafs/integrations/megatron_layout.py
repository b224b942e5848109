"""Pure Megatron-core → Hugging Face layout math: names, tensor-parallel merges, expected shapes.

No torch.distributed and no megatron import here, so every rule can be tested on plain tensors and
reused offline (e.g. on the per-rank state dicts of a saved Megatron checkpoint).

Megatron names used here are "global": `decoder.layers.N.` carries the layer's index in the whole
model (not in its pipeline stage), and wrapper prefixes (`module.`) are gone.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from deltafs.errors import UsageError


class MegatronLayoutError(UsageError):
    """Megatron tensors that do not fit the model's configuration (shapes, names, ranks)."""


class Split(enum.Enum):
    """How a parameter is split over tensor-parallel ranks."""

    REPLICATED = "replicated"  # norms: every rank holds the whole tensor
    QKV = "qkv"  # fused linear_qkv: dim 0, whole query groups per rank
    GLU = "glu"  # fused linear_fc1: dim 0, each rank holds [gate_r; up_r]
    ROW = "row"  # linear_proj, linear_fc2: dim 1
    VOCAB = "vocab"  # word embeddings, output layer: dim 0, padded vocabulary


@dataclass(frozen=True)
class Arch:
    """The shape facts of a Llama/Qwen-family GPT model that the conversion needs."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int  # the tokenizer's vocabulary: what HF tensors keep
    padded_vocab_size: int  # what Megatron allocates (divisible by TP and a padding multiple)
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool

    def __post_init__(self) -> None:
        if self.num_heads % self.num_query_groups:
            raise MegatronLayoutError(
                f"num_attention_heads ({self.num_heads}) is not a multiple of num_query_groups ({self.num_query_groups})")
        if not 0 < self.vocab_size <= self.padded_vocab_size:
            raise MegatronLayoutError(
                f"vocab_size {self.vocab_size} must be between 1 and the model's padded vocabulary {self.padded_vocab_size}")

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_query_groups


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Megatron suffix inside a layer → (split, HF suffixes inside model.layers.N.).
# The TransformerEngine spec fuses the two pre-norms into the next linear; both spellings map here.
_LAYER_PARAMS: dict[str, tuple[Split, tuple[str, ...]]] = {
    "input_layernorm.weight": (Split.REPLICATED, ("input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": (Split.REPLICATED, ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": (Split.QKV, ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                     "self_attn.v_proj.weight")),
    "self_attention.linear_qkv.bias": (Split.QKV, ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                                   "self_attn.v_proj.bias")),
    "self_attention.q_layernorm.weight": (Split.REPLICATED, ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": (Split.REPLICATED, ("self_attn.k_norm.weight",)),
    "self_attention.linear_proj.weight": (Split.ROW, ("self_attn.o_proj.weight",)),
    "pre_mlp_layernorm.weight": (Split.REPLICATED, ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": (Split.REPLICATED, ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": (Split.GLU, ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": (Split.ROW, ("mlp.down_proj.weight",)),
}
_TOP_PARAMS: dict[str, tuple[Split, tuple[str, ...]]] = {
    "embedding.word_embeddings.weight": (Split.VOCAB, ("model.embed_tokens.weight",)),
    "decoder.final_layernorm.weight": (Split.REPLICATED, ("model.norm.weight",)),
    "output_layer.weight": (Split.VOCAB, ("lm_head.weight",)),
}


def is_skipped(name: str) -> bool:
    """State-dict entries that are not weights: TransformerEngine/fp8 bookkeeping."""
    return name.endswith("_extra_state")


def split_of(name: str) -> Split:
    """How the tensor called `name` (a global Megatron name) is split over TP ranks."""
    return _rule(name)[0]


def hf_names(name: str, arch: Arch) -> tuple[str, ...]:
    """The HF tensors one Megatron parameter becomes (none for a tied output layer)."""
    if name == "output_layer.weight" and arch.tied_embeddings:
        # With pipeline parallelism the last stage keeps a synchronized copy of the embedding;
        # HF models tie lm_head to embed_tokens, so the copy is not published.
        return ()
    m = _LAYER.match(name)
    if m:
        return tuple(f"model.layers.{m.group(1)}.{s}" for s in _rule(name)[1])
    return _rule(name)[1]


def _rule(name: str) -> tuple[Split, tuple[str, ...]]:
    m = _LAYER.match(name)
    rule = _LAYER_PARAMS.get(m.group(2)) if m else _TOP_PARAMS.get(name)
    if rule is None:
        raise MegatronLayoutError(f"unexpected Megatron parameter {name!r}: not part of a Llama/Qwen-family GPT model")
    return rule


def expected_hf_shapes(arch: Arch) -> dict[str, tuple[int, ...]]:
    """Every tensor the HF checkpoint of `arch` holds, with its shape."""
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_heads * d, arch.num_query_groups * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, h), "model.norm.weight": (h,)}
    if not arch.tied_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    for n in range(arch.num_layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (arch.ffn_hidden_size, h),
            p + "mlp.up_proj.weight": (arch.ffn_hidden_size, h),
            p + "mlp.down_proj.weight": (h, arch.ffn_hidden_size),
        }
        if arch.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if arch.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    return shapes


def expected_shard_shape(name: str, arch: Arch, tp: int) -> tuple[int, ...]:
    """The shape each of `tp` ranks holds for a Megatron parameter."""
    h, d = arch.hidden_size, arch.head_dim
    split = split_of(name)
    qkv_rows = arch.num_query_groups * (arch.heads_per_group + 2) * d
    full: tuple[int, ...]
    if split is Split.REPLICATED:
        return (d,) if ".q_layernorm." in name or ".k_layernorm." in name else (h,)
    if split is Split.QKV:
        full = (qkv_rows, h) if name.endswith(".weight") else (qkv_rows,)
        dim = 0
    elif split is Split.GLU:
        full, dim = (2 * arch.ffn_hidden_size, h), 0
    elif split is Split.ROW:
        full, dim = ((h, arch.num_heads * d) if "linear_proj" in name else (h, arch.ffn_hidden_size)), 1
    else:
        full, dim = (arch.padded_vocab_size, h), 0
    if full[dim] % tp:
        raise MegatronLayoutError(f"{name}: dimension {dim} of size {full[dim]} does not split over {tp} TP ranks")
    return tuple(n // tp if i == dim else n for i, n in enumerate(full))


def merge_tp(name: str, shards: Sequence[torch.Tensor], arch: Arch) -> dict[str, torch.Tensor]:
    """Turn the TP shards of one Megatron parameter (in TP-rank order) into its HF tensors."""
    split = split_of(name)
    out_names = hf_names(name, arch)
    if not out_names:
        return {}
    tp = len(shards)
    want = expected_shard_shape(name, arch, tp)
    for rank, shard in enumerate(shards if split is not Split.REPLICATED else shards[:1]):
        if tuple(shard.shape) != want:
            raise MegatronLayoutError(
                f"{name} on TP rank {rank} has shape {tuple(shard.shape)}, expected {want} for this model at TP={tp}")
    if split is Split.REPLICATED:
        return {out_names[0]: shards[0]}
    if split is Split.ROW:
        return {out_names[0]: torch.cat(list(shards), dim=1)}
    if split is Split.VOCAB:
        # Rows past the tokenizer's vocabulary are padding that no token id reaches.
        return {out_names[0]: torch.cat(list(shards), dim=0)[: arch.vocab_size]}
    if split is Split.GLU:
        # Each rank's shard is [gate_r; up_r]: gate is the first half of every shard, not of the whole.
        halves = [s.chunk(2, dim=0) for s in shards]
        return {out_names[0]: torch.cat([g for g, _ in halves], dim=0),
                out_names[1]: torch.cat([u for _, u in halves], dim=0)}
    return dict(zip(out_names, _split_qkv(torch.cat(list(shards), dim=0), arch), strict=True))


def _split_qkv(fused: torch.Tensor, arch: Arch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused rows are grouped per query group: [q heads of the group, k, v] for each group in turn."""
    g, hpg, d = arch.num_query_groups, arch.heads_per_group, arch.head_dim
    rest = tuple(fused.shape[1:])
    grouped = fused.reshape(g, (hpg + 2) * d, *rest)
    q = grouped[:, : hpg * d].reshape(g * hpg * d, *rest)
    k = grouped[:, hpg * d: (hpg + 1) * d].reshape(g * d, *rest)
    v = grouped[:, (hpg + 1) * d:].reshape(g * d, *rest)
    return q.contiguous(), k.contiguous(), v.contiguous()


def convert_shards(tp_state_dicts: Sequence[Mapping[str, Any]], arch: Arch) -> dict[str, torch.Tensor]:
    """HF tensors from the state dicts of every TP rank of one pipeline stage (global layer names).

    Replicated tensors are taken from TP rank 0; `_extra_state` and non-tensor entries are skipped.
    """
    if not tp_state_dicts:
        raise MegatronLayoutError("no tensor-parallel state dicts given")
    names = [sorted(n for n, t in sd.items() if not is_skipped(n) and isinstance(t, torch.Tensor)) for sd in tp_state_dicts]
    for rank, ns in enumerate(names[1:], 1):
        if ns != names[0]:
            diff = sorted(set(ns) ^ set(names[0]))
            raise MegatronLayoutError(f"TP rank {rank} holds other parameters than TP rank 0: {diff[:5]}")
    out: dict[str, torch.Tensor] = {}
    for name in names[0]:
        out |= merge_tp(name, [sd[name] for sd in tp_state_dicts], arch)
    return out


def check_complete(tensors: Mapping[str, torch.Tensor], arch: Arch) -> None:
    """Refuse a conversion that misses tensors, has extra ones, or has wrong shapes."""
    want = expected_hf_shapes(arch)
    missing = sorted(set(want) - set(tensors))
    extra = sorted(set(tensors) - set(want))
    if missing or extra:
        raise MegatronLayoutError(f"converted model is incomplete: missing {missing[:5]}, unexpected {extra[:5]}"
                                  + (" (did every pipeline stage take part?)" if missing else ""))
    for name, shape in want.items():
        if tuple(tensors[name].shape) != shape:
            raise MegatronLayoutError(f"{name} has shape {tuple(tensors[name].shape)}, expected {shape}")


__all__ = ["Arch", "MegatronLayoutError", "Split", "check_complete", "convert_shards", "expected_hf_shapes",
           "expected_shard_shape", "hf_names", "is_skipped", "merge_tp", "split_of"]
