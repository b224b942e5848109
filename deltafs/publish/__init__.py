"""Trainer side: a checkpoint directory or in-memory tensors in, chunks then a manifest then HEAD out.

Stages, one module each: plan (version, keyframe policy, base/cache validity), encode (chunks),
commit (manifest then HEAD), fold, hf (the safetensors shard writer), source (reading a checkpoint);
pipeline runs them for a world of 1..N ranks; push, push_tensors and push_distributed are its entry points.
"""

from deltafs.publish.device_diff import DeviceBaseline
from deltafs.publish.distributed import push_distributed
from deltafs.publish.hf import DEFAULT_SHARD_BYTES, write_hf_checkpoint
from deltafs.publish.options import (
    DEFAULT_KEYFRAME_BUDGET,
    DEFAULT_KEYFRAME_EVERY,
    PushOptions,
    PushResult,
)
from deltafs.publish.pipeline import DistributedPushError
from deltafs.publish.push import push, push_tensors

__all__ = [
    "DEFAULT_KEYFRAME_BUDGET",
    "DEFAULT_KEYFRAME_EVERY",
    "DEFAULT_SHARD_BYTES",
    "DeviceBaseline",
    "DistributedPushError",
    "PushOptions",
    "PushResult",
    "push",
    "push_distributed",
    "push_tensors",
    "write_hf_checkpoint",
]
