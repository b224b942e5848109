"""A plain-torch Llama / Qwen2 / Qwen3 forward pass that reads an HF checkpoint directory.

Written from the Hugging Face modeling code's definitions (not from Megatron's), so agreeing logits
mean the published names, layouts and config.json are what an HF loader expects:
  RMSNorm in fp32; q/k/v/o projections (Qwen2: q/k/v bias); Qwen3: per-head q_norm/k_norm before
  RoPE; rotate_half RoPE with rope_theta and optional "llama3" rope_scaling; GQA by repeating k/v
  heads; softmax(q k^T * head_dim**-0.5) with a causal mask; SwiGLU MLP; lm_head or tied embeddings.
"""

from __future__ import annotations

import glob
import json
import math
import os
from typing import Any

import torch
from safetensors.torch import load_file


def load_checkpoint(path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    with open(os.path.join(path, "config.json")) as fh:
        config = json.load(fh)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        tensors |= load_file(f)
    return config, tensors


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _inv_freq(cfg: dict[str, Any]) -> torch.Tensor:
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    rs = cfg.get("rope_scaling")
    if rs:
        assert rs["rope_type"] == "llama3", rs
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / lo, old / hi
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def logits(path: str, input_ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq, vocab] logits of the checkpoint at `path` (fp32 math)."""
    cfg, w = load_checkpoint(path)
    assert cfg["model_type"] in ("llama", "qwen2", "qwen3"), cfg["model_type"]
    assert cfg["hidden_act"] == "silu"
    w = {k: v.float() for k, v in w.items()}
    b, s = input_ids.shape
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // nh
    eps = cfg["rms_norm_eps"]
    freqs = torch.outer(torch.arange(s, dtype=torch.float32), _inv_freq(cfg))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[None, None], emb.sin()[None, None]
    mask = torch.full((s, s), float("-inf")).triu(1)

    x = w["model.embed_tokens.weight"][input_ids]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)

        def proj(name: str, t: torch.Tensor, p: str = p) -> torch.Tensor:
            out = t @ w[p + f"self_attn.{name}.weight"].T
            bias = w.get(p + f"self_attn.{name}.bias")
            return out + bias if bias is not None else out

        q = proj("q_proj", h).view(b, s, nh, d).transpose(1, 2)
        k = proj("k_proj", h).view(b, s, nkv, d).transpose(1, 2)
        v = proj("v_proj", h).view(b, s, nkv, d).transpose(1, 2)
        if cfg["model_type"] == "qwen3":
            q = _rms(q, w[p + "self_attn.q_norm.weight"], eps)
            k = _rms(k, w[p + "self_attn.k_norm.weight"], eps)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        att = torch.softmax(q @ k.transpose(-1, -2) * d ** -0.5 + mask, dim=-1)
        o = (att @ v).transpose(1, 2).reshape(b, s, nh * d)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    x = _rms(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else w["lm_head.weight"]
    return x @ head.T
