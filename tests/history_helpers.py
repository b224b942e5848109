"""Helpers shared by the trainer-side tests."""

from __future__ import annotations

import os

import numpy as np

from deltafs.publish import push
from deltafs.testing.checkpoints import CheckpointMaker, write_safetensors


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


class MovingSubset:
    """An optimizer-like history: the same 2.5% of the weights move at every step."""

    def __init__(self, root, n: int = 100_000) -> None:
        self.root = root
        self.rng = np.random.default_rng(0)
        self.w = self.rng.standard_normal(n).astype(np.float32)
        self.idx = self.rng.choice(n, n // 40, replace=False)
        self.step = 0

    def write(self) -> str:
        path = str(self.root / f"step{self.step}")
        write_safetensors(path + "/model.safetensors", {"w": ("F32", (self.w.size,), self.w.tobytes())})
        with open(path + "/config.json", "w") as fh:
            fh.write('{"hidden_size": 8}\n')
        self.step += 1
        self.w[self.idx] += self.rng.standard_normal(self.idx.size).astype(np.float32) * 1e-3
        return path


def moving_history(tmp_path, n: int, **kwargs):
    """Push n steps of a MovingSubset into tmp_path/store; (store, version -> source dir, version -> PushResult, repo)."""
    from deltafs.store.repo import Repository

    store = str(tmp_path / "store")
    gen = MovingSubset(tmp_path / "src")
    srcs, results = {}, {}
    for _ in range(n):
        res = push(store, gen.write(), **kwargs)
        srcs[res.version], results[res.version] = gen.root / f"step{gen.step - 1}", res
    return store, srcs, results, Repository.open(store)
