"""Manifest handling in a push and a pull of a model with many tensors: how often a manifest is parsed and checked,
and what that costs next to the whole command.

    python benchmarks/manifest_bench.py --work /tmp/manifest-bench --tensors 8000 --json docs/manifest_bench.json

Makes a checkpoint of --tensors F32 tensors of 256 elements (1 KiB each, every one its own chunk: the shape of a
many-expert model's small tensors), pushes it (untimed) and pulls it (untimed), changes every tensor a little,
then times one delta push and one update pull, counting the full manifest checks (`Manifest._check_parsed`, or
`from_parsed` before it existed) and the time spent in them: once in the process that made the templates (a
trainer or watcher that keeps running) and once with each step in a new process (the CLI).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def make_checkpoint(path: Path, tensors: int, seed: int) -> None:
    import numpy as np

    from deltafs.testing.checkpoints import write_safetensors

    rng = np.random.default_rng(0)
    base = rng.standard_normal((tensors, 256)).astype(np.float32)
    if seed:
        base += rng.standard_normal(base.shape).astype(np.float32) * np.float32(1e-4) * base
    path.mkdir(parents=True, exist_ok=True)
    write_safetensors(str(path / "model.safetensors"),
                      {f"layers.{i // 64}.experts.{i % 64}.bias": ("F32", (256,), base[i].tobytes())
                       for i in range(tensors)})


class Counter:
    """Counts and times the full manifest checks while installed."""

    def __init__(self) -> None:
        from deltafs.format.manifest import Manifest

        self.cls = Manifest
        self.name = "_check_parsed" if "_check_parsed" in Manifest.__dict__ else "from_parsed"
        self.orig = Manifest.__dict__[self.name]
        self.calls, self.seconds = 0, 0.0

    def __enter__(self) -> Counter:
        func = self.orig.__func__

        def counted(cls: Any, *a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return func(cls, *a, **k)
            finally:
                self.calls += 1
                self.seconds += time.perf_counter() - t

        setattr(self.cls, self.name, classmethod(counted))
        return self

    def __exit__(self, *exc: Any) -> None:
        setattr(self.cls, self.name, self.orig)


def timed_step(step: str, run: Path, new: Path, threads: int) -> dict[str, Any]:
    from deltafs import pull, push

    with Counter() as c:
        t = time.perf_counter()
        if step == "push":
            push(str(run / "store"), str(new), cache_dir=str(run / "cache"), threads=threads)
        else:
            pull(str(run / "store"), str(run / "dest"), threads=threads)
        return {"seconds": time.perf_counter() - t, "manifest_checks": c.calls, "check_seconds": c.seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/deltafs-manifest-bench")
    ap.add_argument("--tensors", type=int, default=8000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--step", choices=("push", "pull"), help=argparse.SUPPRESS)  # one timed step, in this process
    args = ap.parse_args()
    if args.step:
        import deltafs  # noqa: F401  # imported before the clock starts

        print(json.dumps(timed_step(args.step, Path(args.work) / "run", Path(args.work) / "new", args.threads)))
        return
    import deltafs
    from deltafs import pull, push

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    make_checkpoint(work / "base", args.tensors, 0)
    make_checkpoint(work / "new", args.tensors, 1)
    tmpl = work / "tmpl"
    push(str(tmpl / "store"), str(work / "base"), cache_dir=str(tmpl / "cache"))
    pull(str(tmpl / "store"), str(tmpl / "dest"))
    out: dict[str, Any] = {"deltafs": getattr(deltafs, "__version__", "?"), "tensors": args.tensors,
                           "threads": args.threads, "python": sys.version.split()[0]}
    for mode in ("same process", "fresh process"):
        run = work / "run"
        shutil.rmtree(run, ignore_errors=True)
        subprocess.run(["cp", "-a", str(tmpl), str(run)], check=True)
        for step in ("push", "pull"):
            if mode == "same process":  # a trainer or watcher that keeps running: it pushed / pulled v1 itself
                res = timed_step(step, run, work / "new", args.threads)
            else:  # the CLI: a new process per command
                done = subprocess.run([sys.executable, __file__, "--step", step, "--work", str(work),
                                       "--threads", str(args.threads)], check=True, capture_output=True, text=True)
                res = json.loads(done.stdout.splitlines()[-1])
            out[f"{step}, {mode}"] = res
    manifest = next((work / "run" / "store" / "manifests").iterdir())
    out["manifest_stored_bytes"] = manifest.stat().st_size
    shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
