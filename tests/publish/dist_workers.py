"""Rank bodies for the multi-rank push tests (run in spawned processes with gloo on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import signal
import traceback
import zlib
from datetime import timedelta
from typing import Any

import torch

MODEL_SHAPES = {
    "model.embed_tokens.weight": (96, 32),
    "model.layers.0.self_attn.q_proj.weight": (32, 32),
    "model.layers.0.self_attn.k_proj.weight": (16, 32),
    "model.layers.0.mlp.up_proj.weight": (64, 32),
    "model.layers.0.input_layernorm.weight": (32,),
    "model.layers.1.self_attn.q_proj.weight": (32, 32),
    "model.layers.1.mlp.down_proj.weight": (32, 64),
    "model.norm.weight": (32,),
    "lm_head.weight": (96, 32),
}
CONFIG = b'{"architectures": ["LlamaForCausalLM"], "hidden_size": 32}\n'


def model_at(step: int) -> dict[str, torch.Tensor]:
    """Deterministic bf16 weights after `step` optimizer-like updates (about 2% of elements change per step)."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name, shape in MODEL_SHAPES.items():
        w = torch.randn(shape, generator=gen, dtype=torch.float32)
        for s in range(1, step + 1):
            g = torch.Generator().manual_seed(zlib.crc32(f"{name}:{s}".encode()))
            mask = torch.rand(shape, generator=g) < 0.02
            w = w + mask * torch.randn(shape, generator=g) * 0.05
        out[name] = w.to(torch.bfloat16)
    return out


def owned(step: int, rank: int, world: int) -> dict[str, torch.Tensor]:
    return {n: t for i, (n, t) in enumerate(model_at(step).items()) if i % world == rank}


def run(rank: int, world: int, port: int, out_dir: str, scenario: str, args: dict[str, Any]) -> None:
    import torch.distributed as dist

    os.environ["DELTAFS_CACHE"] = args["cache"]
    result: dict[str, Any] = {"rank": rank}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=args.get("timeout", 90)))
        result.update(SCENARIOS[scenario](rank, world, args))
        result["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        result.update(ok=False, error=type(exc).__name__, message=str(exc), tb=traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def _push(rank: int, world: int, args: dict[str, Any], **kw: Any) -> dict[str, Any]:
    from deltafs.publish.distributed import push_distributed

    step = args["step"]
    tensors = kw.pop("tensors", None)
    if tensors is None:
        tensors = owned(step, rank, world)
    extra = {"config.json": CONFIG} if rank == 0 else {}
    if rank == world - 1:
        extra["tokenizer/tokenizer.json"] = b'{"v": 1}'
    extra.update(kw.pop("extra_files", {}))
    res = push_distributed(args["store"], tensors, extra_files=extra, metadata={"step": step}, **kw)
    return {"result": res.to_json()}


def push_steps(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    out = []
    for step in args["steps"]:
        out.append(_push(rank, world, {**args, "step": step}, **args.get("push_kwargs", {}))["result"])
    return {"results": out}


def duplicate_owner(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    tensors = owned(0, rank, world)
    if rank == 1:
        # Claims rank 0's embedding too, with another shape.
        tensors["model.embed_tokens.weight"] = torch.zeros(95, 32, dtype=torch.bfloat16)
    return _push(rank, world, {**args, "step": 0}, tensors=tensors)


def extra_file_repeats_a_tensor(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Rank 1 adds an extra .safetensors file holding a tensor rank 0 pushes."""
    from safetensors.torch import save

    extra = {}
    if rank == 1:
        name = next(iter(owned(0, 0, world)))
        extra = {"extra.safetensors": save({name: torch.zeros(3)})}
    return _push(rank, world, {**args, "step": 0}, extra_files=extra)


def fail_then_succeed(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Version 1; then a push where rank 1 fails while writing (no commit); then the same push again."""
    first = _push(rank, world, {**args, "step": 0})["result"]
    failed: dict[str, Any] = {}
    try:
        # Rank 1's push cache cannot be created (its parent is a file): it fails, the others must not commit.
        blocker = os.path.join(os.path.dirname(args["store"]), "not-a-directory")
        open(blocker, "w").close()
        kw = {"cache_dir": os.path.join(blocker, "cache")} if rank == 1 else {}
        _push(rank, world, {**args, "step": 1}, **kw)
    except Exception as exc:  # noqa: BLE001
        failed = {"error": type(exc).__name__, "message": str(exc)}
    from deltafs.store.repo import Repository

    versions_after_failure = Repository.open(args["store"]).versions()
    again = _push(rank, world, {**args, "step": 1})["result"]
    return {"first": first, "failed": failed, "versions_after_failure": versions_after_failure, "again": again}


def die_while_writing(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Rank 1 is SIGKILLed after it has written a few chunks; the others must not commit."""
    if rank == 1:
        from deltafs.store.repo import Repository

        real = Repository.put_chunk
        count = [0]

        def put_chunk(self: Repository, data: bytes, oid: str | None = None) -> tuple[str, bool]:
            out = real(self, data, oid)
            count[0] += 1
            if count[0] == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        Repository.put_chunk = put_chunk  # type: ignore[method-assign]
    return _push(rank, world, {**args, "step": args["step"]}, threads=1)


def dtensor_state_dict(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Every rank passes the same names as DTensors sharded over all ranks (an FSDP2 state dict)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from deltafs.publish.distributed import push_distributed

    mesh = init_device_mesh("cpu", (world,))
    out = []
    for step in args["steps"]:
        state = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in model_at(step).items()}
        res = push_distributed(args["store"], state, extra_files={"config.json": CONFIG}, metadata={"step": step},
                               fold=True)
        out.append(res.to_json())
    return {"results": out}


def bad_file_on_one_rank(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Rank 1 passes an extra file named like a shard that is no valid safetensors, then stays alive (as a trainer
    rank that logs the error): every rank must fail at once, not wait out the process group's timeout."""
    import time

    from deltafs.publish.distributed import push_distributed

    extra = {"extra.safetensors": b"not safetensors"} if rank == 1 else {}
    t0 = time.monotonic()
    try:
        push_distributed(args["store"], owned(0, rank, world), extra_files=extra)
        return {"pushed": True}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - t0}
    finally:
        time.sleep(0.5 if rank == 1 else 0)


def die_while_the_root_commits(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Rank 1 is SIGKILLed when it waits for the root's commit: the root commits, then cannot tell everyone."""
    if rank == 1:
        from deltafs.publish import pipeline

        real = pipeline.from_root

        def from_root(world_: Any, what: str, fn: Any) -> Any:
            if what == "committing":
                os.kill(os.getpid(), signal.SIGKILL)
            return real(world_, what, fn)

        pipeline.from_root = from_root  # type: ignore[assignment]
    return _push(rank, world, {**args, "step": args["step"]}, threads=1)


SCENARIOS = {
    "extra_file_repeats_a_tensor": extra_file_repeats_a_tensor,
    "die_while_the_root_commits": die_while_the_root_commits,
    "bad_file_on_one_rank": bad_file_on_one_rank,
    "dtensor_state_dict": dtensor_state_dict,
    "push_steps": push_steps,
    "duplicate_owner": duplicate_owner,
    "fail_then_succeed": fail_then_succeed,
    "die_while_writing": die_while_writing,
}


def local_error_then_continue(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """A trainer's loop that logs a failed push and goes on. At step 1 rank 1 alone passes a bad option: it used to
    raise before the first collective, so its step-2 call met the others' step-1 call and version 2 mixed the two."""
    _push(rank, world, {**args, "step": 0})
    steps = []
    for step in (1, 2):
        kw = {"threads": 0} if rank == 1 and step == 1 else {}
        try:
            steps.append({"result": _push(rank, world, {**args, "step": step}, **kw)["result"]})
        except Exception as exc:  # noqa: BLE001
            steps.append({"error": type(exc).__name__, "message": str(exc)})
    return {"steps": steps}


def disagree_on_root(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Each rank names itself the root: the broadcasts would never meet (a wait for the group timeout)."""
    return _push(rank, world, {**args, "step": 0}, root=rank)


def rank_on_a_store_copy(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """After version 1, rank 1 is given a copy of the store (same store id, another path)."""
    import shutil

    import torch.distributed as dist

    _push(rank, world, {**args, "step": 0})
    copy = args["store"] + "-copy"
    if rank == 0:
        shutil.copytree(args["store"], copy)
    dist.barrier()
    failed: dict[str, Any] = {}
    try:
        _push(rank, world, {**args, "step": 1, "store": copy if rank == 1 else args["store"]})
    except Exception as exc:  # noqa: BLE001
        failed = {"error": type(exc).__name__, "message": str(exc)}
    dist.barrier()
    again = _push(rank, world, {**args, "step": 1})["result"]
    return {"failed": failed, "again": again}


SCENARIOS.update(local_error_then_continue=local_error_then_continue, disagree_on_root=disagree_on_root,
                 rank_on_a_store_copy=rank_on_a_store_copy)


def fold_on_the_root_only(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Only the root passes fold=True, and no rank gives a step: each version must still be one step's tensors."""
    from deltafs.publish.distributed import push_distributed

    out = []
    for step in args["steps"]:
        extra = {"config.json": CONFIG} if rank == 0 else {}
        res = push_distributed(args["store"], owned(step, rank, world), extra_files=extra, fold=rank == 0)
        out.append(res.to_json())
    return {"results": out}
SCENARIOS.update(fold_on_the_root_only=fold_on_the_root_only)


def own_labels_and_a_bad_baseline(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """on_every_rank with a label naming the rank; then rank 1 passes a device_baseline that is no DeviceBaseline."""
    from deltafs.publish.distributed import on_every_rank, push_distributed

    got = on_every_rank(f"loading shard {rank}", lambda: rank * 10)
    refused: dict[str, Any] = {}
    try:
        push_distributed(args["store"], owned(0, rank, world), device_baseline=object() if rank == 1 else None)
    except Exception as exc:  # noqa: BLE001
        refused = {"error": type(exc).__name__, "message": str(exc)}
    again = _push(rank, world, {**args, "step": 0})["result"]
    return {"got": got, "refused": refused, "again": again}


SCENARIOS.update(own_labels_and_a_bad_baseline=own_labels_and_a_bad_baseline)
