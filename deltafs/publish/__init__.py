"""Trainer side: a checkpoint directory or in-memory tensors in, chunks then a manifest then HEAD out."""

from deltafs.publish.push import (
    DEFAULT_KEYFRAME_BUDGET,
    DEFAULT_KEYFRAME_EVERY,
    PushResult,
    push,
    push_tensors,
    write_hf_checkpoint,
)
from deltafs.publish.distributed import push_distributed

__all__ = [
    "DEFAULT_KEYFRAME_BUDGET",
    "DEFAULT_KEYFRAME_EVERY",
    "PushResult",
    "push",
    "push_distributed",
    "push_tensors",
    "write_hf_checkpoint",
]
