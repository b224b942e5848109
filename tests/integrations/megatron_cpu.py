"""Run real megatron-core GPT models on CPU with gloo, for tests only.

megatron-core 0.16.1 assumes CUDA in three places that a tiny CPU model reaches; `cpu_patches()`
replaces exactly those for as long as it is active (the library never patches anything):
  - torch.cuda.current_device: RoPE moves inv_freq to it on the first forward;
  - the model-parallel CUDA RNG tracker: forking it reads/writes CUDA RNG states (CPU RNG instead);
  - the causal attention mask: the default one is built on device="cuda", so tests pass
    `causal_mask(seq)` explicitly;
  - Tensor.cuda (identity): with pipeline parallelism and tied embeddings, megatron moves the
    embedding copy to CUDA before all-reducing it between the first and last stage.
Used in-process by conftest.py and by megatron_worker.py in spawned ranks.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F


@contextlib.contextmanager
def cpu_patches() -> Iterator[None]:
    from megatron.core.tensor_parallel import random as mrandom

    saved = [(torch.cuda, "current_device"), (torch.cuda, "get_rng_state"), (torch.cuda, "manual_seed"),
             (mrandom, "_get_cuda_rng_state"), (mrandom, "_set_cuda_rng_state"), (torch.Tensor, "cuda")]
    old = [(obj, name, getattr(obj, name)) for obj, name in saved]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda seed: None  # type: ignore[assignment]
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        for obj, name, value in old:
            setattr(obj, name, value)


def init_parallel(tp: int = 1, pp: int = 1, vpp: int | None = None, seed: int = 1234) -> None:
    """Megatron's parallel state on an already initialized gloo process group."""
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vpp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


@dataclass(frozen=True)
class Tiny:
    """A tiny Llama/Qwen-family model: 3 layers, GQA 4 heads / 2 groups, padded vocabulary."""

    layers: int = 3
    hidden: int = 64
    heads: int = 4
    groups: int = 2
    head_dim: int = 16
    ffn: int = 96
    vocab: int = 100  # the "tokenizer" vocabulary
    padded_vocab: int = 128  # what Megatron allocates
    tied: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_theta: float = 10000.0
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    eps: float = 1e-6
    dtype: torch.dtype = torch.float32


def build(tiny: Tiny, *, seed: int = 0, pre_process: bool = True, post_process: bool = True,
          vp_stage: int | None = None, **config_overrides: Any) -> Any:
    """A megatron-core GPTModel with the local (non-TransformerEngine) layer spec, initialized on CPU."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    params: dict[str, Any] = dict(
        num_layers=tiny.layers, hidden_size=tiny.hidden, num_attention_heads=tiny.heads,
        num_query_groups=tiny.groups, kv_channels=tiny.head_dim, ffn_hidden_size=tiny.ffn,
        normalization="RMSNorm", layernorm_epsilon=tiny.eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=tiny.qkv_bias, qk_layernorm=tiny.qk_norm,
        use_cpu_initialization=True, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        params_dtype=tiny.dtype, pipeline_dtype=tiny.dtype, init_method_std=0.05,
    )
    params |= config_overrides
    config = TransformerConfig(**params)
    spec_args: dict[str, Any] = {"normalization": params["normalization"], "qk_layernorm": tiny.qk_norm}
    if params.get("num_moe_experts"):
        spec_args["num_experts"] = params["num_moe_experts"]
    torch.manual_seed(seed)  # CPU initialization draws the full weights from this RNG on every rank
    model = GPTModel(config, get_gpt_layer_local_spec(**spec_args), vocab_size=tiny.padded_vocab,
                     max_sequence_length=64, pre_process=pre_process, post_process=post_process,
                     parallel_output=False, share_embeddings_and_output_weights=tiny.tied,
                     position_embedding_type="rope", rotary_base=int(tiny.rope_theta),
                     rope_scaling=tiny.rope_scaling, rope_scaling_factor=tiny.rope_scaling_factor,
                     vp_stage=vp_stage)
    return model


def causal_mask(seq: int) -> torch.Tensor:
    """True where attention is masked: the explicit CPU replacement for megatron's default CUDA mask."""
    return torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)


def tokens(batch: int = 2, seq: int = 12, vocab: int = 100, seed: int = 7) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def forward(model: Any, toks: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [batch, seq, padded_vocab] (the model gathers its TP output)."""
    b, s = toks.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    return model(toks, pos, causal_mask(s))


def train_step(model: Any, toks: torch.Tensor, lr: float = 1e-2) -> None:
    """One Adam step on a next-token loss: every weight changes, replicated ones identically on every TP rank."""
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    logits = forward(model, toks)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), toks[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env_for_rank(rank: int, world: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return env
