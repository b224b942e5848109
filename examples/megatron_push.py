"""Publish weights from a Megatron-core training loop with deltafs.

    torchrun --nproc-per-node 2 examples/megatron_push.py --store /tmp/deltafs-store --tp 2 --steps 20 --push-every 5
    deltafs pull /tmp/deltafs-store /models/current        # on a rollout host

Builds a small Qwen3-style GPTModel (GQA, q/k RMSNorm, SwiGLU, RoPE, padded vocabulary) with
megatron-core, trains it on random tokens, and every --push-every steps calls `push_megatron` on
every rank: the tensor-parallel shards are gathered to rank 0, renamed to Hugging Face Qwen3 names,
and pushed as the store's next version (a delta against the previous one).

Needs CUDA (NCCL) like any Megatron job; extras: pip install 'deltafs[megatron]'.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.nn.functional as F

from deltafs.integrations.megatron import push_megatron

# The original HF config of the model being trained: token ids and serving-time settings ride along;
# shape fields must agree with the Megatron model (push_megatron checks).
HF_CONFIG = {"model_type": "qwen3", "vocab_size": 1000, "bos_token_id": 1, "eos_token_id": 2,
             "max_position_embeddings": 4096}


def build_model(*, layers: int = 4, hidden: int = 256, heads: int = 8, groups: int = 2, ffn: int = 704,
                vocab_size: int = HF_CONFIG["vocab_size"], device: str = "cuda") -> Any:
    """A megatron-core GPTModel of the Qwen3 family (local layer spec, so no TransformerEngine needed)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp = parallel_state.get_tensor_model_parallel_world_size()
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
        kv_channels=hidden // heads, ffn_hidden_size=ffn, normalization="RMSNorm", layernorm_epsilon=1e-6,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, qk_layernorm=True,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, use_cpu_initialization=True, tensor_model_parallel_size=tp)
    padded = -(-vocab_size // (128 * tp)) * 128 * tp  # Megatron pads the vocabulary like this by default
    model = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True),
                     vocab_size=padded, max_sequence_length=512, position_embedding_type="rope",
                     rotary_base=1_000_000, share_embeddings_and_output_weights=True, parallel_output=False)
    return model.to(device)


def train(model: Any, store: str, *, steps: int, push_every: int, seq: int = 64, batch: int = 4,
          cache_dir: str | None = None, multi_rank: bool = False) -> list[Any]:
    """Train on random tokens; push at step 0 and every `push_every` steps. Returns this rank's PushResults."""
    device = next(model.parameters()).device
    vocab = HF_CONFIG["vocab_size"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)  # same batch on every TP rank, as Megatron's data loader gives
    positions = torch.arange(seq, device=device).unsqueeze(0).expand(batch, -1)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device), diagonal=1)
    results = []
    for step in range(steps + 1):
        if step % push_every == 0:
            # Collective: every rank calls it. Single writer: rank 0 writes and gets the PushResult, the
            # others None. multi_rank: each pipeline stage writes its own layers; every rank gets it.
            result = push_megatron(model, store, config=HF_CONFIG, metadata={"step": step}, cache_dir=cache_dir,
                                   multi_rank=multi_rank)
            if result is not None:
                results.append(result)
            if result is not None and _rank() == 0:
                print(f"step {step}: version {result.version} ({result.kind}), "
                      f"{result.bytes_written / 1e6:.2f} MB written of {result.full_bytes / 1e6:.2f} MB")
        if step == steps:
            break
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(device)
        logits = model(tokens[:, :-1], positions, mask)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return results


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True, help="deltafs store URL (a path, file://, s3://, gs://, ...)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--push-every", type=int, default=5)
    parser.add_argument("--multi-rank", action="store_true", help="every pipeline stage writes its own layers")
    args = parser.parse_args()

    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)  # CPU initialization: the same full weights on every rank before sharding
    model = build_model(device="cuda")
    train(model, args.store, steps=args.steps, push_every=args.push_every, multi_rank=args.multi_rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
