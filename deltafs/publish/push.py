"""Single-process entry points: a checkpoint directory (push) or tensors from Python (push_tensors).

Both run the one pipeline (deltafs.publish.pipeline) as a world of one.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Unpack

from deltafs.errors import UsageError
from deltafs.publish.device_diff import DeviceBaseline, baseline_push
from deltafs.publish.hf import DEFAULT_SHARD_BYTES, plan_checkpoint
from deltafs.publish.options import PushKeywords, PushOptions, PushResult
from deltafs.publish.pipeline import RankWork, Solo, run
from deltafs.publish.source import memory_source, scan_source
from deltafs.store.repo import Repository


def push(store: str | Repository, src: str, options: PushOptions | None = None, *,
         include: Sequence[str] | None = None, exclude: Sequence[str] | None = None, default_excludes: bool = True,
         **kw: Unpack[PushKeywords]) -> PushResult:
    """Publish the checkpoint at src (a directory or a .safetensors file) as the store's next version.

    options, or the same fields as keywords (push(store, src, version=7, fold=True)); see PushOptions.
    include/exclude/default_excludes: which files of src are published (deltafs.publish.select).
    fold=True also writes, for a delta two or more steps past its full version, a folded delta from
    that full version straight to the new version (deltafs.read.chain), so lagging readers take one step.
    """
    t0 = time.monotonic()
    opts = PushOptions.of(options, **kw)
    # Before touching the store: a bad source writes nothing.
    files = scan_source(src, include=include, exclude=exclude, default_excludes=default_excludes)
    return run(Solo(), store, RankWork(files), opts, t0=t0)


def push_tensors(store: str | Repository, tensors: Mapping[str, Any], options: PushOptions | None = None, *,
                 extra_files: Mapping[str, bytes] | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                 keep_files: bool = True, device_baseline: DeviceBaseline | None = None,
                 **kw: Unpack[PushKeywords]) -> PushResult:
    """Publish a mapping of HF names to torch tensors (plus files such as config.json) as the next version.

    The tensors are streamed into chunks as safetensors shards (deltafs.publish.hf) without a
    temporary checkpoint on disk: host tensors are read in place, tensors on an accelerator are copied
    to the host a chunk at a time as they are encoded (DeviceBytes); none may change until this returns.
    keep_files: the previous version's plain files that extra_files does not replace (tokenizer files,
    generation_config.json ...) stay in the new version.
    DTensor values (FSDP2) are gathered with full_tensor(), a collective over their mesh: with more
    than one rank, call push_distributed on every rank instead, which spreads the writing.
    device_baseline: keep the pushed accelerator tensors' previous version on their devices (one more copy of
    them there), so a push copies only the changed elements to the host (deltafs.publish.device_diff); pass the
    same DeviceBaseline to every push of this model.
    """
    t0 = time.monotonic()
    opts = PushOptions.of(options, **kw)
    if not isinstance(tensors, Mapping):
        raise UsageError(f"push_tensors takes a mapping of names to tensors (a state dict), got {type(tensors).__name__}")
    if not tensors:
        raise UsageError("push_tensors got no tensors (an empty state dict would publish a model of nothing)")
    _refuse_sharded_dtensors(tensors)
    with baseline_push(device_baseline) as done:
        plan = plan_checkpoint(tensors, max_shard_bytes=max_shard_bytes, extra_files=extra_files,
                               device_baseline=device_baseline)
        files = memory_source(plan.files())
        return done(run(Solo(), store, RankWork(files, inherit_files=keep_files), opts, t0=t0))


def _refuse_sharded_dtensors(tensors: Mapping[str, Any]) -> None:
    for name, t in tensors.items():
        if type(t).__name__ == "DTensor" and t.device_mesh.size() > 1:
            raise UsageError(f"{name} is a DTensor sharded over {t.device_mesh.size()} ranks: call "
                             "deltafs.push_distributed(store, state_dict) on every rank instead of push_tensors")


__all__ = ["push", "push_tensors"]
