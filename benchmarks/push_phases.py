"""Where a delta push's time goes, by phase: wall-clock timers wrapped around the push's own functions.

    python benchmarks/push_phases.py /tmp/sync-bench/gen-llama-1b-L4-lr9e-07-s0/tmpl-push \
        /tmp/sync-bench/gen-llama-1b-L4-lr9e-07-s0/new --rounds 5 --threads 1 [--level L] [--json OUT]
    PYTHONPATH=/tmp/v0 python benchmarks/push_phases.py ...   # another checkout's deltafs, same timers

pull_phases.py's counterpart, with its timers. TEMPLATE is a sync_bench push template (`store/` and `cache/` with the base pushed
as HEAD); NEW the checkpoint to push. Each round copies the store to --scratch and the cache beside NEW (not
timed; page cache warm), then runs `deltafs.push(store, NEW, cache_dir=..., threads=T)` in this process: the push
cache is hard-linked, as sync_bench's "cache beside the checkpoint" row. --cache-root on another filesystem
makes it patched instead.

Timers are summed over every call, in every thread, per round; the least and the median over the rounds are
printed. With threads > 1 the worker phases overlap and add up to more than the push; with 1 thread the worker
phases (read, codec, digest) are parts of `Encoder._chunk`, while the store's writes (`_put_batch`) run beside
them in their own threads. Each timer costs ~1 us per call. Never a test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

from pull_phases import ACC, _timed  # the same timers (benchmarks/ is on sys.path when a script there runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("template")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--scratch", default="/dev/shm/push-phases")
    ap.add_argument("--cache-root", help="where the cache copy goes (default: beside NEW, on its filesystem)")
    ap.add_argument("--level", type=int, help="the push's zstd level (default: push's)")
    ap.add_argument("--json")
    args = ap.parse_args()

    import deltafs
    import deltafs.publish.push  # noqa: F401  (the module, not the function the package exports)
    from deltafs.publish import encode, pipeline

    push_mod = sys.modules["deltafs.publish.push"]

    def timed(owner: Any, name: str, label: str) -> None:
        setattr(owner, name, _timed(label, getattr(owner, name)))

    timed(push_mod, "scan_source", "scan the source")
    timed(pipeline, "decide", "read the store (decide)")
    timed(pipeline._Rank, "_prepare_base", "find the base (_prepare_base)")
    timed(encode.Encoder, "encode", "Encoder.encode")
    timed(encode.Encoder, "_chunk", "  worker: _chunk")
    timed(encode.Encoder, "_read", "    read a chunk or its base")
    timed(encode.Encoder, "_run_reads", "    read a run of small chunks")
    timed(encode.codec, "encode", "    codec.encode (compare included)")
    timed(encode.digests, "chunk_digest", "    chunk digests (new and base)")
    timed(encode.Encoder, "_put_batch", "  store writes (_put_batch, own threads)")
    timed(encode, "place_file", "  cache link (place_file)")
    timed(pipeline, "seal_manifest", "seal the manifest")
    timed(pipeline, "commit_version", "commit")
    timed(pipeline._Rank, "install", "install the cache")

    cache = os.path.join(args.cache_root or os.path.dirname(os.path.abspath(args.new)), "push-phases-cache")
    rounds: list[dict[str, float]] = []
    for _ in range(args.rounds):
        for d in (args.scratch, cache):
            shutil.rmtree(d, ignore_errors=True)
        os.makedirs(args.scratch)
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        subprocess.run(["cp", "-a", os.path.join(args.template, "store"), os.path.join(args.scratch, "store")],
                       check=True)
        subprocess.run(["cp", "-a", os.path.join(args.template, "cache"), cache], check=True)
        ACC.clear()
        t0 = time.perf_counter()
        deltafs.push(os.path.join(args.scratch, "store"), args.new, cache_dir=cache, threads=args.threads,
                     **({} if args.level is None else {"level": args.level}))
        rounds.append({**ACC, "push (wall)": time.perf_counter() - t0})
    for d in (args.scratch, cache):
        shutil.rmtree(d, ignore_errors=True)
    labels = list(rounds[0])
    out = {"deltafs": deltafs.__file__, "threads": args.threads, "rounds": args.rounds, "phases": {}}
    for label in sorted(labels, key=lambda k: -statistics.median(r.get(k, 0.0) for r in rounds)):
        values = [r.get(label, 0.0) for r in rounds]
        out["phases"][label] = {"least_s": min(values), "median_s": statistics.median(values)}
        print(f"{label:44s} least {min(values) * 1e3:8.1f} ms  median {statistics.median(values) * 1e3:8.1f} ms")
    print(f"deltafs: {deltafs.__file__}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
