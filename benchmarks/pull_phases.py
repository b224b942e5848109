"""Where an update pull's time goes, by phase: wall-clock timers wrapped around the pull's own functions.

    python benchmarks/pull_phases.py /tmp/sync-bench/trained-20M-lr1e-06-seed0/tmpl-pull --rounds 20 --threads 1
    python benchmarks/pull_phases.py /tmp/sync-bench/gen-llama-1b-L4-lr9e-07-s0/tmpl-pull --rounds 6

TEMPLATE is a sync_bench pull template (`benchmarks/sync_bench.py run` makes them): `store/` and `dest` (a DEST two
versions behind HEAD) with `dest.deltafs/`. Each round copies it to --scratch (not timed; page cache warm, as a
watcher's pull finds it) and runs `deltafs.read.pull.pull` in this process (API, recycling the oldest version).

Timers are summed over every call, in every thread, and divided by the rounds. With threads > 1 the worker phases
(decode, base reads, writes, digests, object reads) overlap one another and add up to more than the build's wall
time; with 1 thread they are its parts. Each timer costs ~1 us per call. Never a test.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import os
import shutil
import threading
import time
from typing import Any

ACC: collections.defaultdict[str, float] = collections.defaultdict(float)
_ACC_LOCK = threading.Lock()  # workers add to one label at once


def _timed(label: str, fn: Any) -> Any:
    """fn, its wall-clock time added to ACC[label] on every call, in any thread (push_phases.py uses it too)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = time.perf_counter() - t0
            with _ACC_LOCK:
                ACC[label] += spent
    return wrapper


def instrument() -> Any:
    """Wrap the phases; returns the pull function to call."""
    pull_mod = importlib.import_module("deltafs.read.pull")
    dest = importlib.import_module("deltafs.read.dest")
    rebuild = importlib.import_module("deltafs.read.rebuild")
    repo = importlib.import_module("deltafs.store.repo")
    local = importlib.import_module("deltafs.store.local")
    # Module-level names the pull looks up at call time.
    for name in ("refuse_foreign", "resolve_version", "precheck", "check_layout"):
        setattr(pull_mod, name, _timed(name, getattr(pull_mod, name)))
    for cls, names in ((dest.LocalCheckpoint, ("recycle_as_staging", "install", "cleanup", "describe_foreign")),
                       (rebuild.Builder, ("build", "_local_bytes", "_check_segment", "_finish_file")),
                       (rebuild.ChunkSource, ("get",)), (repo.Repository, ("get_chunk",)),
                       (local.LocalObjectStore, ("_read",))):
        for name in names:
            setattr(cls, name, _timed(f"{cls.__name__}.{name}", getattr(cls, name)))
    rebuild.codec = _Proxy(rebuild.codec, {"decode": _timed("codec.decode", rebuild.codec.decode)})
    rebuild.digests = _Proxy(rebuild.digests, {"chunk_digest": _timed("chunk_digest", rebuild.digests.chunk_digest)})
    rebuild.pwrite_all = _timed("pwrite_all", rebuild.pwrite_all)
    return pull_mod.pull


class _Proxy:
    """A module with some functions replaced, for one importer only."""

    def __init__(self, module: Any, overrides: dict[str, Any]) -> None:
        self._module, self._overrides = module, overrides

    def __getattr__(self, name: str) -> Any:
        return self._overrides.get(name) or getattr(self._module, name)


def copy_template(template: str, work: str) -> None:
    """The template as it is (DEST stays a relative link into dest.deltafs), like sync_bench's `cp -a`."""
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(template, work, symlinks=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("template")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--scratch", default="/dev/shm/pull-phases")
    a = ap.parse_args()
    pull = instrument()
    walls = []
    for _ in range(a.rounds):
        copy_template(a.template, a.scratch)
        t0 = time.perf_counter()
        pull(os.path.join(a.scratch, "store"), os.path.join(a.scratch, "dest"), threads=a.threads, recycle=True)
        walls.append(time.perf_counter() - t0)
    shutil.rmtree(a.scratch, ignore_errors=True)
    walls.sort()
    print(f"pull, {a.threads} thread(s), {a.rounds} rounds: min {walls[0] * 1e3:.1f} ms, "
          f"median {walls[len(walls) // 2] * 1e3:.1f} ms, mean {sum(walls) / len(walls) * 1e3:.1f} ms")
    print("phase (ms per pull, summed over threads)")
    for label, seconds in sorted(ACC.items(), key=lambda kv: -kv[1]):
        print(f"  {label:34s} {seconds / a.rounds * 1e3:8.2f}")


if __name__ == "__main__":
    main()
