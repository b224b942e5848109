"""One rank of a multi-process Megatron-core job on CPU (gloo), started by test_megatron_distributed.py.

    python megatron_worker.py SPEC_JSON        (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment)

SPEC: {"tp": 2, "pp": 1, "tiny": {...Tiny fields...}, "store": URL, "cache": DIR, "out": DIR, "steps": 1,
       "rank_tiny": {RANK: {...Tiny fields that differ on that rank...}} (optional)}
Each rank builds the model, then for step 0..steps: (after an Adam step when step > 0) computes the
full logits, and calls push_megatron on every rank. Rank 0 writes logits-<step>.pt and
push-<step>.json (the PushResult) to OUT; the test pulls and compares.
Pipeline parallel runs the forward by hand: stage 0 sends its hidden states to stage 1.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_cpu as mc  # noqa: E402


def pipeline_logits(model: Any, toks: torch.Tensor, pp_rank: int, tiny: mc.Tiny) -> torch.Tensor | None:
    """Two-stage forward: stage 0's hidden states [s, b, h] go to stage 1, which returns logits."""
    from megatron.core import parallel_state as ps

    b, s = toks.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    group = ps.get_pipeline_model_parallel_group()
    if pp_rank == 0:
        hidden = model(toks, pos, mc.causal_mask(s))
        dist.send(hidden.detach().contiguous(), dst=dist.get_global_rank(group, 1), group=group)
        return None
    hidden = torch.empty(s, b, tiny.hidden, dtype=tiny.dtype)
    dist.recv(hidden, src=dist.get_global_rank(group, 0), group=group)
    model.set_input_tensor(hidden)
    return model(toks, pos, mc.causal_mask(s))


def main() -> None:
    spec = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tp, pp = spec["tp"], spec["pp"]
    # "rank_tiny": {"1": {"ffn": 128}} builds a different model on rank 1 (the bad-input test).
    tiny = mc.Tiny(**(spec["tiny"] | spec.get("rank_tiny", {}).get(str(rank), {})))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    with mc.cpu_patches():
        mc.init_parallel(tp=tp, pp=pp)
        from megatron.core import parallel_state as ps

        from deltafs.integrations.megatron import push_megatron

        pp_rank = ps.get_pipeline_model_parallel_rank()
        model = mc.build(tiny, pre_process=pp_rank == 0, post_process=pp_rank == pp - 1)
        toks = mc.tokens()
        for step in range(spec["steps"] + 1):
            if step:
                mc.train_step(model, toks)
            with torch.no_grad():
                logits = mc.forward(model, toks) if pp == 1 else pipeline_logits(model, toks, pp_rank, tiny)
            result = push_megatron(model, spec["store"], vocab_size=tiny.vocab, metadata={"step": step},
                                   cache_dir=spec["cache"], **spec.get("push", {}))
            if rank == 0:
                assert result is not None
                with open(os.path.join(spec["out"], f"push-{step}.json"), "w") as fh:
                    json.dump(asdict(result), fh)
            else:
                assert result is None, f"rank {rank} got a push result"
            if logits is not None and ps.get_tensor_model_parallel_rank() == 0:
                torch.save(logits[..., : tiny.vocab].float(), os.path.join(spec["out"], f"logits-{step}.pt"))
        mc.destroy_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
