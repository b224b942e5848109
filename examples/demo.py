"""End-to-end demo on a local store: a simulated trainer pushes versions, a rollout host pulls them.

Runs the real `deltafs` command line for every step and prints each command. Everything lands in
./demo-work (removed first). Usage: python examples/demo.py [--versions N] [--model tiny|small]
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shlex
import shutil
import subprocess
import sys

from deltafs.testing.generator import CONFIGS, TrainerSim, write_checkpoint

WORK = os.path.abspath("demo-work")


def deltafs(*args: str) -> str:
    cmd = [sys.executable, "-m", "deltafs.cli.main", *args]
    print(f"\n$ deltafs {' '.join(shlex.quote(a) for a in args)}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "DELTAFS_CACHE": os.path.join(WORK, "cache")})
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    if proc.returncode != 0:
        sys.exit(f"demo failed: deltafs {args[0]} exited {proc.returncode}")
    return proc.stdout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--model", default="small", choices=sorted(CONFIGS))
    args = ap.parse_args()
    shutil.rmtree(WORK, ignore_errors=True)
    store = os.path.join(WORK, "store")
    dest = os.path.join(WORK, "rollout", "model")
    sim = TrainerSim(args.model, seed=0, lr=1e-6)
    tensors = sim.export()
    for step in range(args.versions):
        src = os.path.join(WORK, "trainer", f"step-{step}")
        write_checkpoint(src, tensors, sim.config, step=step)
        deltafs("push", src, store, "--meta", f"step={step}")
        if step == 1:
            deltafs("pull", store, dest)  # the rollout host starts here; later pulls are incremental
        tensors = sim.step()
    deltafs("pull", store, dest)
    deltafs("verify", store, "--all")
    deltafs("verify", store, "--local", dest)
    deltafs("log", store)
    last = os.path.join(WORK, "trainer", f"step-{args.versions - 1}")
    names = sorted(os.listdir(last))
    match, mismatch, errors = filecmp.cmpfiles(last, dest, names, shallow=False)
    if mismatch or errors:
        sys.exit(f"demo failed: files differ: {mismatch + errors}")
    print(f"\nok: {dest} -> {os.readlink(dest)} is byte-identical to the trainer's last checkpoint ({len(match)} files)")


if __name__ == "__main__":
    main()
