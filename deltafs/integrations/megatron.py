"""Publish a megatron-core GPT model (Llama/Qwen family) as a Hugging Face checkpoint version.

    from deltafs.integrations.megatron import push_megatron
    push_megatron(model, "s3://bucket/run-7", hf_arch="qwen3", vocab_size=151936)   # on every rank

Supported: RMSNorm, SwiGLU MLP, grouped-query attention, RoPE (optionally Llama-3 scaling), tied or
untied embeddings, QKV bias (Qwen2) or q/k RMSNorm (Qwen3), any tensor- and pipeline-parallel layout
(virtual pipeline chunks too), local or TransformerEngine layer specs. Anything else (MoE, MLA,
LayerNorm, GELU, linear biases, ...) is refused before any tensor moves or anything is written.

The functions that move tensors (megatron_to_hf, megatron_stage_to_hf, push_megatron) are
collective: call them on every rank. By default pipeline rank 0 / TP rank 0 / DP rank 0 (normally
global rank 0) gets the whole model and writes, and the other ranks get None; with
push_megatron(multi_rank=True) every pipeline stage writes its own layers through
deltafs.publish.distributed.push_distributed. describe, check_supported and hf_config are local.
Layout rules: megatron_layout.py; torch.distributed moves: megatron_gather.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Unpack

import torch

from deltafs.errors import UsageError
from deltafs.publish.device_diff import DeviceBaseline
from deltafs.publish.options import PushKeywords, PushOptions, PushResult
from deltafs.integrations.megatron_gather import Groups, Plan, gather_model, gather_stage, groups_of, plan
from deltafs.integrations.megatron_layout import Arch, MegatronLayoutError, check_complete, is_skipped

HF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


class UnsupportedModelError(UsageError):
    """A Megatron model outside what deltafs can publish as an HF checkpoint."""


@dataclass(frozen=True)
class ModelInfo:
    """Everything needed to write the HF tensors and config.json of a Megatron model."""

    arch: Arch
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    dtype: torch.dtype
    initializer_range: float


# --- what the model is -----------------------------------------------------------------------------

def model_chunks(model_or_chunks: Any) -> list[Any]:
    """The GPTModel(s) of this rank, unwrapped from DDP / Float16Module (`.module`) wrappers."""
    chunks = list(model_or_chunks) if isinstance(model_or_chunks, (list, tuple)) else [model_or_chunks]
    if not chunks:
        raise UsageError("no Megatron model given")
    out = []
    for chunk in chunks:
        seen = 0
        while not hasattr(chunk, "decoder") and hasattr(chunk, "module") and seen < 8:
            chunk, seen = chunk.module, seen + 1
        if not (hasattr(chunk, "decoder") and hasattr(chunk, "config")):
            raise UnsupportedModelError(f"{type(chunk).__name__} is not a megatron-core GPTModel")
        out.append(chunk)
    return out


def _problems(model: Any) -> list[str]:
    """Each way the model leaves the Llama/Qwen family, as a short phrase."""
    c = model.config

    def get(field: str, default: Any = None) -> Any:
        return getattr(c, field, default)  # fields come and go between megatron-core versions

    act = get("activation_func")
    act_name = getattr(act, "__name__", repr(act))
    kv = get("kv_channels") or c.hidden_size // c.num_attention_heads
    scale = get("softmax_scale")
    rope = getattr(model, "rotary_pos_emb", None)
    checks = [
        (get("num_moe_experts") is None, f"mixture of experts (num_moe_experts={get('num_moe_experts')})"),
        (get("normalization") == "RMSNorm", f"normalization={get('normalization')!r} (needs 'RMSNorm')"),
        (bool(get("gated_linear_unit")) and act_name == "silu",
         f"MLP gated_linear_unit={get('gated_linear_unit')} activation={act_name} (needs SwiGLU)"),
        (not get("add_bias_linear"), "add_bias_linear=True (biases on every linear layer)"),
        (not get("multi_latent_attention"), "multi-latent attention"),
        (getattr(model, "position_embedding_type", "rope") == "rope",
         f"position_embedding_type={getattr(model, 'position_embedding_type', None)!r} (needs 'rope')"),
        (float(getattr(model, "rotary_percent", 1.0)) == 1.0, f"rotary_percent={getattr(model, 'rotary_percent', None)}"),
        (not get("rotary_interleaved"), "rotary_interleaved=True"),
        (getattr(rope, "seq_len_interpolation_factor", None) is None, "seq_len_interpolation_factor"),
        (not get("attention_output_gate"), "attention_output_gate=True"),
        (not get("qk_l2_norm"), "qk_l2_norm=True"),
        (get("experimental_attention_variant") is None, f"attention variant {get('experimental_attention_variant')!r}"),
        (get("window_size") is None, f"sliding-window attention (window_size={get('window_size')})"),
        (get("no_rope_freq") is None, "layers without RoPE (no_rope_freq)"),
        (not get("mtp_num_layers"), "multi-token prediction layers"),
        (not get("heterogeneous_block_specs"), "heterogeneous layers"),
        (not get("is_hybrid_model"), "hybrid (Mamba) model"),
        (not get("layernorm_zero_centered_gamma"), "layernorm_zero_centered_gamma=True"),
        (not get("apply_residual_connection_post_layernorm"), "apply_residual_connection_post_layernorm=True"),
        (get("softmax_type", "vanilla") == "vanilla", f"softmax_type={get('softmax_type')!r}"),
        (not get("glu_linear_offset"), f"glu_linear_offset={get('glu_linear_offset')}"),
        (get("activation_func_clamp_value") is None, "activation_func_clamp_value"),
        (not get("fp8_param") and not get("fp4_param"), "fp8/fp4 parameters (publish from a bf16 copy)"),
        (scale is None or math.isclose(scale, kv ** -0.5, rel_tol=1e-6), f"softmax_scale={scale} (HF uses head_dim**-0.5)"),
        (not (get("qk_layernorm") and get("add_qkv_bias")),
         "QKV bias together with q/k layernorm (no HF Llama/Qwen architecture has both)"),
    ]
    return [what for ok, what in checks if not ok]


def check_supported(model_or_chunks: Any) -> None:
    """Raise UnsupportedModelError listing every unsupported feature of the model."""
    for chunk in model_chunks(model_or_chunks):
        problems = _problems(chunk)
        if problems:
            raise UnsupportedModelError("deltafs can only publish Llama/Qwen-family Megatron models; this one has: "
                                        + "; ".join(problems))


def describe(model_or_chunks: Any, *, vocab_size: int | None = None) -> ModelInfo:
    """Check the model is supported and read its shapes, RoPE and dtype.

    vocab_size: the tokenizer's vocabulary. Megatron pads its embedding rows (to a multiple of
    128 x TP by default); the padding is cut off. Default: keep the model's (padded) size.
    """
    chunks = model_chunks(model_or_chunks)
    check_supported(chunks)
    m, c = chunks[0], chunks[0].config
    head_dim = c.kv_channels or c.hidden_size // c.num_attention_heads
    arch = Arch(num_layers=c.num_layers, hidden_size=c.hidden_size, ffn_hidden_size=c.ffn_hidden_size,
                num_heads=c.num_attention_heads, num_query_groups=c.num_query_groups or c.num_attention_heads,
                head_dim=head_dim, vocab_size=vocab_size or m.vocab_size, padded_vocab_size=m.vocab_size,
                tied_embeddings=bool(m.share_embeddings_and_output_weights), qkv_bias=bool(c.add_qkv_bias),
                qk_norm=bool(c.qk_layernorm))
    theta = float(m.rotary_base)
    scaling = _rope_scaling(m, theta, head_dim)
    dtype = next((p.dtype for p in m.parameters()), c.params_dtype)
    return ModelInfo(arch=arch, rms_norm_eps=float(c.layernorm_epsilon), rope_theta=theta, rope_scaling=scaling,
                     max_position_embeddings=int(m.max_sequence_length), dtype=dtype,
                     initializer_range=float(c.init_method_std))


def _rope_scaling(model: Any, theta: float, head_dim: int) -> dict[str, Any] | None:
    """The HF rope_scaling that reproduces the model's RoPE frequencies; refuse if none does.

    Megatron does not keep its rope_scaling_factor, so it is read back from the lowest frequency
    (which Llama-3 scaling divides by exactly the factor), then the whole vector is checked.
    """
    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    have = getattr(getattr(model, "rotary_pos_emb", None), "inv_freq", None)
    if have is None:
        return None
    have = have.detach().float().cpu()
    if not getattr(model, "rotary_scaling", False):
        if not torch.allclose(have, plain, rtol=1e-5, atol=0):
            raise UnsupportedModelError("the model's RoPE frequencies do not match rotary_base="
                                        f"{theta}; cannot describe them in an HF config")
        return None
    factor = round(float(plain[-1] / have[-1]), 4)
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    if not torch.allclose(llama3_inv_freq(plain, scaling), have, rtol=1e-5, atol=0):
        raise UnsupportedModelError("the model's scaled RoPE frequencies match no Llama-3 rope_scaling")
    return scaling


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    """HF's "llama3" rope_scaling applied to plain RoPE frequencies."""
    factor, lo, hi = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    out = torch.where(wavelen > old / lo, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return torch.where(medium, smoothed, out)


# --- config.json ------------------------------------------------------------------------------------

def hf_config(info: ModelInfo, *, hf_arch: str | None = None, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The HF config.json for the converted model.

    hf_arch: "llama", "qwen2" or "qwen3" (default: from `base`'s model_type, else qwen3 with q/k norm,
    qwen2 with QKV bias, llama otherwise). base: the model's original HF config (token ids, rope
    details, ...); its shape fields must agree with the Megatron model.
    """
    a = info.arch
    base = dict(base or {})
    hf_arch = hf_arch or base.get("model_type") or ("qwen3" if a.qk_norm else "qwen2" if a.qkv_bias else "llama")
    if hf_arch not in HF_ARCHS:
        raise UsageError(f"hf_arch {hf_arch!r} is not one of {sorted(HF_ARCHS)}")
    needs = {"llama": (False, False), "qwen2": (True, False), "qwen3": (False, True)}[hf_arch]
    if (a.qkv_bias, a.qk_norm) != needs:
        raise UnsupportedModelError(
            f"{hf_arch} expects qkv_bias={needs[0]} and q/k norm={needs[1]}; the model has qkv_bias={a.qkv_bias} "
            f"and q/k norm={a.qk_norm} (llama: neither, qwen2: QKV bias, qwen3: q/k RMSNorm)")
    derived: dict[str, Any] = {
        "architectures": [HF_ARCHS[hf_arch]],
        "model_type": hf_arch,
        "hidden_size": a.hidden_size,
        "intermediate_size": a.ffn_hidden_size,
        "num_hidden_layers": a.num_layers,
        "num_attention_heads": a.num_heads,
        "num_key_value_heads": a.num_query_groups,
        "head_dim": a.head_dim,
        "vocab_size": a.vocab_size,
        "tie_word_embeddings": a.tied_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": info.rms_norm_eps,
        "rope_theta": info.rope_theta,
        "rope_scaling": info.rope_scaling,
        "max_position_embeddings": info.max_position_embeddings,
        "torch_dtype": str(info.dtype).removeprefix("torch."),
        "attention_dropout": 0.0,
        "initializer_range": info.initializer_range,
        "use_cache": True,
    }
    if hf_arch == "llama":
        derived |= {"attention_bias": False, "mlp_bias": False}
    elif hf_arch == "qwen3":
        derived |= {"attention_bias": False}
    if hf_arch in ("qwen2", "qwen3"):
        derived |= {"use_sliding_window": False, "sliding_window": None, "max_window_layers": a.num_layers}
    _check_base(base, derived)
    out = base | derived
    # Serving-time facts Megatron does not know (or knows only as the training sequence length).
    out |= {k: base[k] for k in _BASE_WINS if base.get(k) is not None}
    return out


# Fields where a given HF config must agree with the model.
_SHAPE_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "rms_norm_eps", "rope_theta")
_BASE_WINS = ("max_position_embeddings", "rope_scaling", "initializer_range", "use_cache", "attention_dropout",
              "use_sliding_window", "sliding_window", "max_window_layers")


def _check_base(base: Mapping[str, Any], derived: Mapping[str, Any]) -> None:
    bad = []
    for key in _SHAPE_KEYS:
        if base.get(key) is None:
            continue
        have, want = base[key], derived[key]
        same = math.isclose(float(have), float(want), rel_tol=1e-6) if isinstance(want, float) else have == want
        if not same:
            bad.append(f"{key}: config says {have!r}, model has {want!r}")
    if bad:
        raise UsageError("the given HF config does not describe this Megatron model: " + "; ".join(bad))


# --- tensors ----------------------------------------------------------------------------------------

def local_state(model_or_chunks: Any) -> dict[str, torch.Tensor]:
    """This rank's parameter shards under global names (layer indices across the whole pipeline)."""
    out: dict[str, torch.Tensor] = {}
    for chunk in model_chunks(model_or_chunks):
        layers = list(getattr(chunk.decoder, "layers", []))
        for name, value in chunk.state_dict().items():
            if is_skipped(name) or not isinstance(value, torch.Tensor):
                continue
            parts = name.split(".")
            if name.startswith("decoder.layers."):
                # layer_number is 1-based and already counts the layers of earlier stages and chunks.
                parts[2] = str(layers[int(parts[2])].layer_number - 1)
            key = ".".join(parts)
            if key in out:
                raise MegatronLayoutError(f"{key} appears in two model chunks of this rank")
            out[key] = value
    return out


def megatron_stage_to_hf(model_or_chunks: Any, *, vocab_size: int | None = None, groups: Groups | None = None,
                         info: ModelInfo | None = None) -> dict[str, torch.Tensor] | None:
    """This pipeline stage's HF tensors (its own layers, global indices) on the stage's first TP rank.

    None on the other ranks. Collective over the model-parallel group. This is the unit a multi-rank
    push writes from every stage in parallel; `megatron_to_hf` collects the stages on one rank.
    """
    stage, _, _, _ = _stage(model_or_chunks, vocab_size, groups, info)
    return stage


def _stage(model_or_chunks: Any, vocab_size: int | None, groups: Groups | None, info: ModelInfo | None
           ) -> tuple[dict[str, torch.Tensor] | None, ModelInfo, Groups, Plan | None]:
    chunks = model_chunks(model_or_chunks)
    info = info or describe(chunks, vocab_size=vocab_size)
    groups = groups or groups_of(chunks[0])
    if groups.is_replica:
        return None, info, groups, None
    local = local_state(chunks)
    the_plan = plan(local, info.arch, groups)
    return gather_stage(local, info.arch, groups, the_plan), info, groups, the_plan


def megatron_to_hf(model_or_chunks: Any, *, vocab_size: int | None = None, groups: Groups | None = None,
                   info: ModelInfo | None = None) -> dict[str, torch.Tensor] | None:
    """Full HF-named CPU tensors of the model on the writing rank; None on every other rank.

    Collective: call on every rank. Shapes, names and ownership are checked on every rank before any
    tensor moves, so a bad layout raises the same error everywhere.
    """
    stage, info, groups, the_plan = _stage(model_or_chunks, vocab_size, groups, info)
    if stage is None or the_plan is None:
        return None
    full = gather_model(stage, info.arch, groups, the_plan)
    if full is not None:
        check_complete(full, info.arch)
    return full


def push_megatron(model_or_chunks: Any, store: Any, options: PushOptions | None = None, *, hf_arch: str | None = None,
                  config: Mapping[str, Any] | None = None, vocab_size: int | None = None,
                  extra_files: Mapping[str, bytes] | None = None, groups: Groups | None = None,
                  multi_rank: bool = False, device_baseline: DeviceBaseline | None = None,
                  **kw: Unpack[PushKeywords]) -> PushResult | None:
    """Convert the model to an HF checkpoint and push it as the store's next version.

    Collective: call on every rank. config: the model's original HF config.json as a dict (keeps
    token ids etc.; its vocab_size is the default for `vocab_size`). extra_files: more files for the
    version (tokenizer files ...). options: deltafs.publish.PushOptions, or its fields as keywords
    (version, metadata, cache_dir, keyframe_every, level, fold, ...).

    multi_rank=False: the model is gathered on one rank, which pushes; it gets the PushResult and the
    other ranks None. multi_rank=True: each pipeline stage's first TP rank encodes and writes its own
    layers in parallel (deltafs.publish.push_distributed over the default group, so every rank of
    the job must call); every rank gets the PushResult. Both run the same push pipeline (folds too).
    device_baseline: a DeviceBaseline kept for the run (one per rank with multi_rank), so only the elements that
    changed since the last push cross from the accelerator to the host (deltafs.publish.device_diff).
    """
    def prepare() -> tuple[PushOptions, ModelInfo, dict[str, bytes], int | None]:
        opts = PushOptions.of(options, **kw)
        vocab = vocab_size
        if vocab is None and config is not None and config.get("vocab_size"):
            vocab = int(config["vocab_size"])
        info = describe(model_or_chunks, vocab_size=vocab)
        cfg = hf_config(info, hf_arch=hf_arch, base=config)  # refuse a bad config before any collective
        files = {"config.json": (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()}
        return opts, info, files | dict(extra_files or {}), vocab

    if multi_rank:
        from deltafs.publish.distributed import on_every_rank, push_distributed

        # Checked inside a collective: a rank refusing its own options alone would leave the others in the push's
        # first collective, where its next call (the next step) would meet them.
        opts, info, files, vocab = on_every_rank("checking the call", prepare)
        stage, _, stage_groups, _ = _stage(model_or_chunks, vocab, groups, info)
        # Only the rank holding the embeddings names the extra files, so they are written once.
        mine = files if stage is not None and stage_groups.pp_rank == 0 else None
        return push_distributed(store, stage or {}, opts, extra_files=mine, device_baseline=device_baseline)

    from deltafs.publish import push_tensors

    opts, info, files, _ = prepare()
    tensors = megatron_to_hf(model_or_chunks, groups=groups, info=info)
    if tensors is None:
        return None
    return push_tensors(store, tensors, opts, extra_files=files, device_baseline=device_baseline)


__all__ = ["HF_ARCHS", "ModelInfo", "UnsupportedModelError", "check_supported", "describe", "hf_config",
           "llama3_inv_freq", "local_state", "megatron_stage_to_hf", "megatron_to_hf", "model_chunks",
           "push_megatron"]
