"""What a push does when the trainer truncates the checkpoint it is pushing: a fault-injection run, tree by tree.

    python benchmarks/cut_short.py TEMPLATE NEW --tree . --tree /tmp/v0 --rounds 20 [--json OUT]

TEMPLATE and NEW as in push_ab.py (a sync_bench push template and the checkpoint to push). Each round, for each
tree in turn: copy the store and cache (`cp -a`) and NEW's files to --scratch, start a push of the copy in a fresh
process (deltafs from the tree, on PYTHONPATH), and once it has imported deltafs and started, wait a random time
within the push's usual duration (measured first, per tree, without a cut) and truncate the copy's largest file to
zero bytes, as a trainer that rewrites its checkpoint in place does (`open(path, "wb")`). The push's outcome is
counted: finished before the cut (exit 0), a clear error (exit 2 and its message), killed by SIGBUS, or anything
else; after each round the store must hold either the previous HEAD or a new version that pulls to exactly NEW.
The random delays are drawn from one seed, the same for every tree. Never a test.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

WORKER = r'''
import os, sys, time
store, src, cache = sys.argv[1:4]
from deltafs import push
from deltafs.errors import DeltafsError, exit_code
print("started", flush=True)
t0 = time.perf_counter()
try:
    push(store, src, cache_dir=cache, threads=int(sys.argv[4]))
except DeltafsError as exc:
    print(f"error {time.perf_counter() - t0:.3f} {exc}", flush=True)
    sys.exit(exit_code(exc))
print(f"pushed {time.perf_counter() - t0:.3f}", flush=True)
'''

CHECK = r'''
import sys
from deltafs.read.pull import pull
from deltafs.store.repo import Repository
from deltafs.testing.checkpoints import files_of
store, dest, new, before = sys.argv[1:5]
repo = Repository.open(store)
head = repo.head().version
if head == int(before):
    print("previous")
else:
    pull(store, dest)
    print("exact" if files_of(dest) == files_of(new) else "WRONG")
'''


def one(tree: str, args: argparse.Namespace, delay: float | None) -> dict[str, Any]:
    scratch = os.path.join(args.scratch, "round")
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    for part in ("store", "cache"):
        subprocess.run(["cp", "-a", os.path.join(args.template, part), os.path.join(scratch, part)], check=True)
    src = os.path.join(scratch, "src")
    shutil.copytree(args.new, src)
    largest = max((os.path.join(src, n) for n in os.listdir(src)), key=os.path.getsize)
    env = {**os.environ, "PYTHONPATH": tree}
    before = subprocess.run([sys.executable, "-c", "import sys; from deltafs.store.repo import Repository; "
                             "print(Repository.open(sys.argv[1]).head().version)", os.path.join(scratch, "store")],
                            env=env, capture_output=True, text=True, check=True).stdout.strip()
    proc = subprocess.Popen([sys.executable, "-c", WORKER, os.path.join(scratch, "store"), src,
                             os.path.join(scratch, "cache"), str(args.threads)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "started"
    cut_at = None
    if delay is not None:
        time.sleep(delay)
        if proc.poll() is None:
            with open(largest, "wb"):  # truncates, as a trainer's in-place rewrite begins
                cut_at = delay
    out, err = proc.communicate()
    rc = proc.returncode
    kind = ("finished" if rc == 0 else "exit 2" if rc == 2 else "SIGBUS" if rc == -signal.SIGBUS else f"rc {rc}")
    check = subprocess.run([sys.executable, "-c", CHECK, os.path.join(scratch, "store"), os.path.join(scratch, "dest"),
                            args.new, before], env=env, capture_output=True, text=True)
    return {"outcome": kind, "cut_at_s": cut_at, "stdout": out.strip()[-300:], "stderr": err.strip()[-300:],
            "store": check.stdout.strip() or f"check failed: {check.stderr.strip()[-300:]}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("template")
    ap.add_argument("new")
    ap.add_argument("--tree", action="append", required=True)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scratch", default="/dev/shm/cut-short")
    ap.add_argument("--json")
    args = ap.parse_args()
    results: dict[str, Any] = {"rounds": args.rounds, "threads": args.threads, "trees": {}}
    for tree in args.tree:
        plain = [one(tree, args, None) for _ in range(2)]
        seconds = min(float(r["stdout"].split()[-1]) for r in plain)
        rng = random.Random(args.seed)
        runs = [one(tree, args, rng.uniform(0.0, seconds)) for _ in range(args.rounds)]
        counts: dict[str, int] = {}
        for r in runs:
            counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
        stores = sorted({r["store"] for r in runs})
        results["trees"][tree] = {"push_s": seconds, "outcomes": counts, "stores": stores, "runs": runs}
        print(f"{tree}: push {seconds:.3f} s uncut; {args.rounds} cut: {counts}; store after: {stores}")
        messages = sorted({r["stdout"].split(" ", 2)[-1] for r in runs if r["outcome"] == "exit 2"})
        for m in messages[:3]:
            print(f"  exit 2: {m}")
    shutil.rmtree(args.scratch, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
