"""Helpers shared by the trainer-side tests."""

from __future__ import annotations

import os

from deltafs.publish import push
from deltafs.testing.checkpoints import CheckpointMaker


def push_history(store: str, maker: CheckpointMaker, n: int, **kwargs) -> dict[int, str]:
    """Push n successive checkpoints; return version -> source directory."""
    out = {}
    for _ in range(n):
        src = maker.write()
        res = push(store, src, **kwargs)
        out[res.version] = src
        maker.advance()
    return out


def store_bytes(path: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            total += os.path.getsize(os.path.join(dirpath, name))
    return total
