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


def bytes_needed(repo, target: int, local: int | None) -> int:
    """Object bytes a reader holding `local` (or nothing) must fetch to rebuild `target`, per the chain rules.

    For every chunk of the target, walk back through its parents until a self-contained record or the
    local version; every distinct stored object on the way is fetched once.
    """
    from deltafs.format.manifest import DELTA_CODECS

    steps = []
    man = repo.manifest(target)
    while True:
        if man.version == local:
            break
        steps.append(man)
        if man.kind == "full":
            break
        man = repo.manifest(man.parent)
    per_step = [m.segments() for m in steps]  # newest first
    needed: dict[str, int] = {}
    for key, (_f, seg) in per_step[0].items():
        for i in range(len(seg.chunks)):
            for segs in per_step:
                rec = segs[key][1].chunks[i]
                if rec.object is not None:
                    needed[rec.object] = rec.object_bytes  # a pack is fetched whole
                if rec.name not in DELTA_CODECS:
                    break
    return sum(needed.values())
