"""Collect a Megatron model's tensor- and pipeline-parallel pieces with torch.distributed.

Two steps, kept apart so a multi-rank push can stop after the first:
  1. `gather_stage`: every TP rank of a pipeline stage sends its shards to the stage's TP rank 0,
     which merges them into HF tensors for the stage's own layers (global layer indices).
  2. `gather_model`: the first rank of every later stage sends those HF tensors to pipeline rank 0.

Before any tensor moves, `plan` exchanges names, shapes and dtypes over the model-parallel group and
every rank checks the same facts, so a mismatch raises the same error on every rank instead of
deadlocking a collective. Only data-parallel (and context-parallel) replica 0 takes part; the other
replicas hold the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from deltafs.integrations.megatron_layout import (
    Arch, MegatronLayoutError, Split, expected_hf_shapes, expected_shard_shape, hf_names, merge_tp, split_of)

ProcessGroup = Any  # torch.distributed.ProcessGroup; Any keeps this importable without a backend


@dataclass(frozen=True)
class Groups:
    """The process groups a Megatron model runs in (all None in a single process)."""

    tp: ProcessGroup | None = None
    pp: ProcessGroup | None = None
    mp: ProcessGroup | None = None  # tensor x pipeline: every rank holding a distinct piece
    dp: ProcessGroup | None = None  # replicas of the same piece (data and context parallel)

    @property
    def tp_rank(self) -> int:
        return _rank(self.tp)

    @property
    def tp_size(self) -> int:
        return _size(self.tp)

    @property
    def pp_rank(self) -> int:
        return _rank(self.pp)

    @property
    def pp_size(self) -> int:
        return _size(self.pp)

    @property
    def is_replica(self) -> bool:
        """True on data/context-parallel replicas other than the first: they sit the gather out."""
        return _rank(self.dp) != 0


def groups_of(model: Any) -> Groups:
    """The groups of a megatron-core model: its `pg_collection`, else megatron's global parallel state."""
    if not (dist.is_available() and dist.is_initialized()):
        return Groups()
    pgs = getattr(model, "pg_collection", None)
    got = {k: getattr(pgs, k, None) for k in ("tp", "pp", "mp", "dp_cp", "dp")} if pgs is not None else {}
    if any(got.get(k) is None for k in ("tp", "pp", "mp")) or (got.get("dp_cp") or got.get("dp")) is None:
        from megatron.core import parallel_state as ps

        got = {"tp": got.get("tp") or ps.get_tensor_model_parallel_group(),
               "pp": got.get("pp") or ps.get_pipeline_model_parallel_group(),
               "mp": got.get("mp") or ps.get_model_parallel_group(),
               "dp_cp": got.get("dp_cp") or got.get("dp") or ps.get_data_parallel_group(with_context_parallel=True)}
    return Groups(tp=got["tp"], pp=got["pp"], mp=got["mp"], dp=got.get("dp_cp") or got.get("dp"))


def _rank(group: ProcessGroup | None) -> int:
    return dist.get_rank(group) if group is not None else 0


def _size(group: ProcessGroup | None) -> int:
    return dist.get_world_size(group) if group is not None else 1


# --- plan: names, shapes and dtypes, checked identically on every rank ------------------------------

@dataclass(frozen=True)
class Plan:
    """What each pipeline stage holds: Megatron name → (dtype, HF names), in transfer order."""

    stages: tuple[tuple[tuple[str, str, tuple[str, ...]], ...], ...]

    def stage(self, pp_rank: int) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
        return self.stages[pp_rank]


# What one rank reports: (tp_rank, pp_rank, {global Megatron name: (shard shape, dtype name)}).
RankReport = tuple[int, int, Mapping[str, tuple[tuple[int, ...], str]]]


def plan(local: Mapping[str, torch.Tensor], arch: Arch, groups: Groups) -> Plan:
    """Exchange every rank's tensor list over the model-parallel group and check it fits `arch`."""
    mine: RankReport = (groups.tp_rank, groups.pp_rank, {n: (tuple(t.shape), str(t.dtype)) for n, t in local.items()})
    everyone: list[Any] = [mine]
    if groups.mp is not None:
        everyone = [None] * _size(groups.mp)
        dist.all_gather_object(everyone, mine, group=groups.mp)
    return check_plan(everyone, arch, groups.tp_size, groups.pp_size)


def check_plan(everyone: Sequence[RankReport], arch: Arch, tp: int, pp: int) -> Plan:
    """The pure check behind `plan`: one entry (tp_rank, pp_rank, {name: (shape, dtype)}) per rank."""
    by_stage: dict[int, dict[int, Mapping[str, tuple[tuple[int, ...], str]]]] = {}
    for tp_rank, pp_rank, tensors in everyone:
        by_stage.setdefault(pp_rank, {})[tp_rank] = tensors
    stages = []
    owner: dict[str, int] = {}
    for pp_rank in range(pp):
        ranks = by_stage.get(pp_rank, {})
        if sorted(ranks) != list(range(tp)):
            raise MegatronLayoutError(f"pipeline stage {pp_rank} reported TP ranks {sorted(ranks)}, expected 0..{tp - 1}")
        names = sorted(ranks[0])
        entries = []
        for tp_rank in range(1, tp):
            if sorted(ranks[tp_rank]) != names:
                diff = sorted(set(ranks[tp_rank]) ^ set(names))
                raise MegatronLayoutError(
                    f"pipeline stage {pp_rank}: TP rank {tp_rank} holds other parameters than TP rank 0: {diff[:5]}")
        for name in names:
            want = expected_shard_shape(name, arch, tp)
            dtypes = set()
            for tp_rank in range(tp):
                shape, dtype = ranks[tp_rank][name]
                dtypes.add(dtype)
                if tuple(shape) != want:
                    raise MegatronLayoutError(
                        f"{name} on TP rank {tp_rank} of pipeline stage {pp_rank} has shape {tuple(shape)}, "
                        f"expected {want} for this model at TP={tp}")
            if len(dtypes) > 1:
                raise MegatronLayoutError(f"{name} has different dtypes on the TP ranks of stage {pp_rank}: {sorted(dtypes)}")
            outs = hf_names(name, arch)
            for out in outs:
                if out in owner:
                    raise MegatronLayoutError(
                        f"{out} is held by pipeline stage {owner[out]} and by stage {pp_rank}: two ranks own the same tensor")
                owner[out] = pp_rank
            entries.append((name, dtypes.pop(), outs))
        stages.append(tuple(entries))
    missing = sorted(set(expected_hf_shapes(arch)) - set(owner))
    if missing:
        raise MegatronLayoutError(f"no pipeline stage holds {missing[:5]}"
                                  + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    return Plan(tuple(stages))


# --- moving tensors --------------------------------------------------------------------------------

def _wire(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The tensor's bytes as uint8 (last dim x itemsize): every backend moves uint8, whatever the
    float type (gloo has no int16/bf16 gather on every build; fp8 has no collectives at all)."""
    return t.detach().contiguous().view(torch.uint8).to(device)


def _unwire(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.cpu().view(dtype)


def _wire_shape(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, ...]:
    return (*shape[:-1], shape[-1] * torch.empty((), dtype=dtype).element_size())


def _device(group: ProcessGroup | None) -> torch.device:
    if group is not None and "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise MegatronLayoutError(f"unknown dtype {name}")
    return dt


def gather_stage(local: Mapping[str, torch.Tensor], arch: Arch, groups: Groups, the_plan: Plan) -> dict[str, torch.Tensor] | None:
    """Merge this pipeline stage's TP shards into HF tensors on its TP rank 0 (None on the others)."""
    tp, me = groups.tp_size, groups.tp_rank
    device = _device(groups.tp)
    lead = dist.get_global_rank(groups.tp, 0) if groups.tp is not None else 0
    out: dict[str, torch.Tensor] | None = {} if me == 0 else None
    for name, dtype_name, outs in the_plan.stage(groups.pp_rank):
        if not outs:
            continue  # e.g. the last stage's copy of tied embeddings
        if tp == 1 or split_of(name) is Split.REPLICATED:
            shards = [local[name].detach().cpu()]
        else:
            mine = _wire(local[name], device)
            bucket = [torch.empty_like(mine) for _ in range(tp)] if me == 0 else None
            dist.gather(mine, bucket, dst=lead, group=groups.tp)
            shards = [_unwire(b, _dtype(dtype_name)) for b in bucket] if bucket is not None else []
        if out is not None:
            out |= merge_tp(name, shards, arch)
    return out


def gather_model(stage: Mapping[str, torch.Tensor] | None, arch: Arch, groups: Groups,
                 the_plan: Plan) -> dict[str, torch.Tensor] | None:
    """Send every stage's HF tensors to pipeline rank 0 (call on the TP-rank-0 of every stage)."""
    if groups.pp is None or groups.pp_size == 1 or stage is None:
        return dict(stage) if stage is not None and groups.pp_rank == 0 else None
    device = _device(groups.pp)
    shapes = expected_hf_shapes(arch)
    first = dist.get_global_rank(groups.pp, 0)
    if groups.pp_rank != 0:
        for _, _, outs in the_plan.stage(groups.pp_rank):
            for out in outs:
                dist.send(_wire(stage[out], device), dst=first, group=groups.pp)
        return None
    full = dict(stage)
    for pp_rank in range(1, groups.pp_size):
        src = dist.get_global_rank(groups.pp, pp_rank)
        for _, dtype_name, outs in the_plan.stage(pp_rank):
            dtype = _dtype(dtype_name)
            for out in outs:
                buf = torch.empty(_wire_shape(shapes[out], dtype), dtype=torch.uint8, device=device)
                dist.recv(buf, src=src, group=groups.pp)
                full[out] = _unwire(buf, dtype)
    return full


__all__ = ["Groups", "Plan", "check_plan", "gather_model", "gather_stage", "groups_of", "plan"]
