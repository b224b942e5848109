"""Realistic trainer versions for tests, demos and benchmarks: an LLM-shaped model under AdamW, exported to bf16.

The model has the tensor names and shapes of a Llama-style HF checkpoint (embedding, GQA attention q/k/v/o, SwiGLU
gate/up/down, RMSNorm weights, lm_head). Master weights are fp32; every `step()` applies one AdamW update driven by
noisy gradients and exports the masters to bf16, which is what a trainer publishes. Because an update is far smaller
than one bf16 ulp for most weights, only a small fraction of bf16 elements change per step; the fraction grows with
the learning rate, roughly linearly: measured with the defaults, about 0.5% at lr=3e-7, 1.4% at lr=1e-6, 2% at
lr=1.5e-6 and 9% at lr=1e-5 for TINY/SMALL (`changed_fraction` measures it). LLAMA_1B as a whole: 0.51% at
lr=1.75e-7 and 2.03% at lr=9e-7 (its decoder layers change more than its embedding).

The optimizer starts in its steady state (moments initialised as if many steps had already run), so the first step
looks like any later one instead of the large, sign-only updates of a freshly started Adam.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

__all__ = [
    "LLAMA_1B",
    "SMALL",
    "TINY",
    "ModelConfig",
    "TrainerSim",
    "changed_fraction",
    "write_checkpoint",
]


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of a Llama-style decoder; `num_layers` may be cut down to keep a benchmark in memory."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_embeddings: bool = False
    max_position_embeddings: int = 4096

    def with_layers(self, num_layers: int) -> ModelConfig:
        """The same model with fewer (or more) decoder layers."""
        return replace(self, num_layers=num_layers, name=f"{self.name}-{num_layers}L")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """HF tensor names to shapes, in checkpoint order."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for n in range(self.num_layers):
            p = f"model.layers.{n}."
            out[p + "input_layernorm.weight"] = (h,)
            out[p + "self_attn.q_proj.weight"] = (self.num_heads * d, h)
            out[p + "self_attn.k_proj.weight"] = (self.num_kv_heads * d, h)
            out[p + "self_attn.v_proj.weight"] = (self.num_kv_heads * d, h)
            out[p + "self_attn.o_proj.weight"] = (h, self.num_heads * d)
            out[p + "post_attention_layernorm.weight"] = (h,)
            out[p + "mlp.gate_proj.weight"] = (i, h)
            out[p + "mlp.up_proj.weight"] = (i, h)
            out[p + "mlp.down_proj.weight"] = (h, i)
        out["model.norm.weight"] = (h,)
        if not self.tie_embeddings:
            out["lm_head.weight"] = (self.vocab_size, h)
        return out

    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.shapes().values())

    def hf_config(self) -> dict[str, Any]:
        """A config.json in the shape transformers writes for LlamaForCausalLM."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_embeddings,
            "torch_dtype": "bfloat16",
            "bos_token_id": 1,
            "eos_token_id": 2,
            "deltafs_generator": asdict(self),
        }


# A few hundred KB of bf16: for unit tests.
TINY = ModelConfig("tiny", vocab_size=512, hidden_size=64, intermediate_size=176, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16)
# About 10 MB of bf16: for end-to-end tests that want several chunks per tensor.
SMALL = ModelConfig("small", vocab_size=4096, hidden_size=256, intermediate_size=688, num_layers=4, num_heads=8,
                    num_kv_heads=2, head_dim=32)
# The shapes of Llama-3.2-1B (1.24B parameters, tied embeddings).
LLAMA_1B = ModelConfig("llama-1b", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                       num_heads=32, num_kv_heads=8, head_dim=64, tie_embeddings=True, max_position_embeddings=131072)

CONFIGS: dict[str, ModelConfig] = {c.name: c for c in (TINY, SMALL, LLAMA_1B)}


class _Param:
    """One fp32 master tensor with its AdamW moments."""

    __slots__ = ("grad_scale", "m", "master", "name", "v")

    def __init__(self, name: str, master: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad_scale: float) -> None:
        self.name, self.master, self.m, self.v, self.grad_scale = name, master, m, v, grad_scale


class TrainerSim:
    """A deterministic stand-in for a trainer: `step()` runs one AdamW update and returns the bf16 export.

    `lr` sets how many bf16 elements change per step. `grad_signal` (0 <= c < 1) feeds the first moment back into
    the gradient, so update signs persist across steps (c = 0: pure noise, as in very noisy RL fine-tuning).
    """

    def __init__(
        self,
        config: ModelConfig | str = TINY,
        seed: int = 0,
        lr: float = 1e-6,
        *,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        grad_signal: float = 0.5,
        init_std: float = 0.02,
        names: Iterable[str] | None = None,
    ) -> None:
        self.config = CONFIGS[config] if isinstance(config, str) else config
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.grad_signal = grad_signal
        self.step_count = 0
        self._gen = torch.Generator().manual_seed(seed)
        shapes = self.config.shapes()
        wanted = list(shapes) if names is None else list(names)
        unknown = set(wanted) - set(shapes)
        if unknown:
            raise KeyError(f"not tensors of {self.config.name}: {sorted(unknown)}")
        # Only the named tensors are simulated (in checkpoint order), so a benchmark can walk a large model a few
        # tensors at a time; the random streams then differ from a whole-model run with the same seed.
        self._params = [self._init_param(name, shapes[name], init_std) for name in shapes if name in set(wanted)]

    def _init_param(self, name: str, shape: tuple[int, ...], init_std: float) -> _Param:
        g = self._gen
        if name.endswith("norm.weight"):
            # Trained RMSNorm gains spread around 1 instead of sitting at their init value.
            master = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            std = init_std
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                std = init_std / math.sqrt(2 * self.config.num_layers)
            # Student-t-like heavier tails than a Gaussian, as trained weights have.
            master = torch.randn(shape, generator=g) * std
            master *= 1.0 + 0.5 * torch.rand(shape, generator=g).pow_(4)
        # Each tensor has its own gradient scale; Adam normalises it away, but it sets the moments' magnitude.
        grad_scale = float(10 ** torch.empty(1).uniform_(-4, -2, generator=g).item())
        m, v = self._steady_moments(shape, grad_scale)
        return _Param(name, master, m, v, grad_scale)

    def _steady_moments(self, shape: tuple[int, ...], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Moments as they look after many steps of the gradient model in `iter_step`.

        With g = noise + c * m and m' = b1 * m + (1 - b1) * g, m is an AR(1) process with coefficient
        a = b1 + (1 - b1) * c, so its stationary std is (1 - b1) * scale / sqrt(1 - a^2); v tracks E[g^2].
        """
        b1, _ = self.betas
        a = b1 + (1 - b1) * self.grad_signal
        m_std = (1 - b1) * scale / math.sqrt(1 - a * a)
        m = torch.randn(shape, generator=self._gen).mul_(m_std)
        v = torch.full(shape, scale * scale + (self.grad_signal * m_std) ** 2)
        return m, v

    @property
    def names(self) -> list[str]:
        return [p.name for p in self._params]

    def export(self) -> dict[str, torch.Tensor]:
        """The current bf16 weights (round to nearest even, as `.to(torch.bfloat16)` does)."""
        return {p.name: p.master.to(torch.bfloat16) for p in self._params}

    def step(self) -> dict[str, torch.Tensor]:
        """One AdamW step on every tensor; returns the new bf16 export."""
        return dict(self.iter_step())

    def iter_step(self) -> Iterator[tuple[str, torch.Tensor]]:
        """One AdamW step, tensor by tensor (keeps only one extra tensor alive at a time); yields (name, bf16)."""
        self.step_count += 1
        b1, b2 = self.betas
        for p in self._params:
            # Gradient = fresh noise + a persistent part. Feeding back m itself as the persistent part keeps memory
            # at three fp32 copies while giving updates a sign that holds for tens of steps, as in real training.
            grad = torch.randn(p.master.shape, generator=self._gen).mul_(p.grad_scale)
            grad.add_(p.m, alpha=self.grad_signal)
            p.m.mul_(b1).add_(grad, alpha=1 - b1)
            p.v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
            update = p.m / p.v.sqrt().add_(self.eps)
            p.master.mul_(1 - self.lr * self.weight_decay).add_(update, alpha=-self.lr)
            del grad, update
            yield p.name, p.master.to(torch.bfloat16)


def changed_fraction(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> float:
    """Fraction of elements whose bit pattern differs between two exports with the same names and shapes."""
    changed = total = 0
    for name, a in old.items():
        b = new[name]
        bits = torch.int16 if a.element_size() == 2 else torch.int32 if a.element_size() == 4 else torch.int8
        changed += int((a.contiguous().view(bits) != b.contiguous().view(bits)).sum())
        total += a.numel()
    return changed / total if total else 0.0


def _tokenizer_files(vocab_size: int) -> dict[str, bytes]:
    """Small tokenizer files in the shape HF tokenizers write (a byte-level vocabulary, no merges)."""
    vocab = {f"<tok_{i}>": i for i in range(min(vocab_size, 256))}
    tokenizer = {
        "version": "1.0",
        "added_tokens": [{"id": 1, "content": "<s>", "special": True}, {"id": 2, "content": "</s>", "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False},
        "model": {"type": "BPE", "vocab": vocab, "merges": []},
    }
    tok_config = {"bos_token": "<s>", "eos_token": "</s>", "model_max_length": 4096,
                  "tokenizer_class": "PreTrainedTokenizerFast"}
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    return {
        "tokenizer.json": _json_bytes(tokenizer),
        "tokenizer_config.json": _json_bytes(tok_config),
        "special_tokens_map.json": _json_bytes(special),
    }


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def write_checkpoint(
    out_dir: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    config: ModelConfig,
    *,
    step: int | None = None,
    shard_bytes: int | None = None,
) -> list[str]:
    """Write an HF-style checkpoint directory; return the relative paths written.

    One `model.safetensors`, or shards `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json` when
    the tensors exceed `shard_bytes`. Also config.json, generation_config.json and small tokenizer files.
    """
    from deltafs.publish.hf import plan_checkpoint, write_files  # the one shard writer

    out = os.fspath(out_dir)
    os.makedirs(out, exist_ok=True)
    meta = {"format": "pt"} if step is None else {"format": "pt", "step": str(step)}
    plan = plan_checkpoint(tensors, max_shard_bytes=shard_bytes, metadata=meta)
    written: list[str] = write_files(plan.files(), out)
    _write(out, "config.json", _json_bytes(config.hf_config()), written)
    gen = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 1.0, "top_p": 1.0}
    _write(out, "generation_config.json", _json_bytes(gen), written)
    for fname, data in _tokenizer_files(config.vocab_size).items():
        _write(out, fname, data, written)
    return written


def _write(out: str, fname: str, data: bytes, written: list[str]) -> None:
    with open(os.path.join(out, fname), "wb") as f:
        f.write(data)
    written.append(fname)
