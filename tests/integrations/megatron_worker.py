"""One rank of a multi-process Megatron-core job on CPU (gloo), started by test_megatron_distributed.py.

    python megatron_worker.py SPEC_JSON        (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment)

SPEC: {"tp": 2, "pp": 1, "vpp": None, "dtype": "float32" | "bfloat16" (bf16 without pipeline only),
       "tiny": {...Tiny fields...}, "store": URL, "cache": DIR, "out": DIR, "steps": 1,
       "rank_tiny": {RANK: {...Tiny fields that differ on that rank...}} (optional),
       "push": {...more push_megatron keyword arguments, e.g. "multi_rank": true...} (optional)}
Each rank builds the model, then for step 0..steps: (after an Adam step when step > 0) computes the
full logits, and calls push_megatron on every rank. Rank 0 writes logits-<step>.pt and
push-<step>.json (the PushResult) to OUT; the test pulls and compares.
Pipeline parallel runs the forward by hand, passing hidden states from stage to stage (and through
virtual pipeline chunks); training steps are only taken without pipeline parallelism.
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


def pipeline_logits(chunks: list[Any], toks: torch.Tensor, pp_rank: int, pp: int, tiny: mc.Tiny) -> torch.Tensor | None:
    """Forward through every (virtual) stage by hand: chunk c of stage p feeds stage p+1, the last stage
    of chunk c feeds chunk c+1 of stage 0. Hidden states are [s, b, h], the same on every TP rank."""
    from megatron.core import parallel_state as ps

    b, s = toks.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    group = ps.get_pipeline_model_parallel_group()
    nxt, prv = (dist.get_global_rank(group, (pp_rank + d) % pp) for d in (1, -1))
    out = None
    for c, chunk in enumerate(chunks):
        if not (pp_rank == 0 and c == 0):
            hidden = torch.empty(s, b, tiny.hidden, dtype=tiny.dtype)
            dist.recv(hidden, src=prv, group=group)
            chunk.set_input_tensor(hidden)
        out = chunk(toks, pos, mc.causal_mask(s))
        if not (pp_rank == pp - 1 and c == len(chunks) - 1):
            dist.send(out.detach().contiguous(), dst=nxt, group=group)
            out = None
    return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tp, pp = spec["tp"], spec["pp"]
    # "rank_tiny": {"1": {"ffn": 128}} builds a different model on rank 1 (the bad-input test).
    tiny = mc.Tiny(**(spec["tiny"] | spec.get("rank_tiny", {}).get(str(rank), {})),
                   dtype=getattr(torch, spec.get("dtype", "float32")))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    with mc.cpu_patches():
        vpp = spec.get("vpp")
        mc.init_parallel(tp=tp, pp=pp, vpp=vpp)
        from megatron.core import parallel_state as ps

        from deltafs.integrations.megatron import megatron_stage_to_hf, push_megatron

        pp_rank = ps.get_pipeline_model_parallel_rank()
        if vpp:
            model: Any = [mc.build(tiny, pre_process=pp_rank == 0 and c == 0,
                                   post_process=pp_rank == pp - 1 and c == vpp - 1, vp_stage=c,
                                   virtual_pipeline_model_parallel_size=vpp) for c in range(vpp)]
        else:
            model = mc.build(tiny, pre_process=pp_rank == 0, post_process=pp_rank == pp - 1,
                             bf16=tiny.dtype == torch.bfloat16)
            if tiny.dtype == torch.bfloat16:
                from megatron.core.transformer.module import Float16Module

                model = Float16Module(model.config, model)  # as bf16 trainers wrap it; norms become bf16 too
        toks = mc.tokens()
        for step in range(spec["steps"] + 1):
            if step:
                mc.train_step(model, toks)
            with torch.no_grad():
                logits = (mc.forward(model, toks) if pp == 1 else
                          pipeline_logits(model if vpp else [model], toks, pp_rank, pp, tiny))
            # "rank_push": {"1:1": {"threads": 0}} gives rank 1 a bad option at step 1 only; with "continue_on_error"
            # a failed push is recorded (error-<rank>-<step>.txt) and the loop goes on, as a trainer's would.
            mine = spec.get("rank_push", {}).get(f"{rank}:{step}", {})
            try:
                result = push_megatron(model, spec["store"], vocab_size=tiny.vocab, metadata={"step": step},
                                       cache_dir=spec["cache"], **(spec.get("push", {}) | mine))
            except Exception as exc:  # noqa: BLE001 - recorded for the test
                if not spec.get("continue_on_error"):
                    raise
                with open(os.path.join(spec["out"], f"error-{rank}-{step}.txt"), "w") as fh:
                    fh.write(f"{type(exc).__name__}: {exc}")
                continue
            multi_rank = spec.get("push", {}).get("multi_rank", False)
            if multi_rank:
                assert result is not None, f"rank {rank} got no push result from a multi-rank push"
            if rank == 0:
                assert result is not None
                with open(os.path.join(spec["out"], f"push-{step}.json"), "w") as fh:
                    json.dump(asdict(result), fh)
            elif not multi_rank:
                assert result is None, f"rank {rank} got a push result"
            if logits is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
                torch.save(logits[..., : tiny.vocab].float(), os.path.join(spec["out"], f"logits-{step}.pt"))
        stage = megatron_stage_to_hf(model, vocab_size=tiny.vocab)
        if stage is not None:  # the first TP rank of each pipeline stage
            with open(os.path.join(spec["out"], f"stage-{pp_rank}.json"), "w") as fh:
                json.dump(sorted(stage), fh)
        mc.destroy_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
