"""A model of thousands of small tensors: delta push and update pull, per store, for one or more deltafs trees.

    python benchmarks/small_tensors.py --work /dev/shm/small --tensors 3000 --rounds 3 \\
        --impl new=. --impl old=/tmp/deltafs-0.2 --stores local,s3 --json docs/small_tensors.json

The checkpoint: --tensors one-dimensional F32 tensors of 64-8191 elements (log-uniform; LayerNorm weights near 1,
biases near 0, other vectors of scale 0.02), as a transformer's norms and biases, or a many-expert model's routers;
one safetensors file. The next version moves ~99% of their elements by an optimizer-sized step, as one AdamW step
moved the F32 tensors of deltafs.testing.trained.

--base DIR --new DIR use two versions on disk instead (e.g. `python -m deltafs.testing.trained OUT --versions 2`,
or a sync-bench data set's base/ and new/).

Each --impl NAME=PATH is a deltafs source tree put first on PYTHONPATH (another checkout: `git worktree add`).
For every round, store and implementation, in turn: a fresh store gets version 1 (a full version: rows "full
push" and "full pull", into an empty DEST), then version 2 is pushed and pulled as an update, each in its own
process, timing the API call only (imports excluded, as benchmarks/sync_bench.py does). Stores: a local directory under --work, and moto's S3 server
in its own process on 127.0.0.1 (`s3`). Also timed: `cp -r` of the checkpoint directory (local).
Counts the objects each version-2 push added under chunks/ and its bytes_written.
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
from pathlib import Path
from typing import Any


def make_versions(out: Path, tensors: int, seed: int = 0) -> None:
    import numpy as np

    rng = np.random.default_rng(seed)
    v1: dict[str, Any] = {}
    for i in range(tensors):
        n = int(np.exp(rng.uniform(np.log(64), np.log(8191))))
        kind = i % 3
        if kind == 0:
            x = 1.0 + 0.05 * rng.standard_normal(n)  # a norm's weight
        elif kind == 1:
            x = 0.01 * rng.standard_normal(n)  # a bias
        else:
            x = 0.02 * rng.standard_normal(n)
        v1[f"layers.{i // 32}.m{i % 32}.{('norm', 'bias', 'gate')[kind]}"] = x.astype(np.float32)
    # One optimizer-sized step: an update of ~1e-6 relative size, zero for ~1% of the elements.
    v2 = {}
    for name, x in v1.items():
        step = (1e-6 * np.sign(rng.standard_normal(x.size)) * np.maximum(np.abs(x), 1e-3)).astype(np.float32)
        step[rng.random(x.size) < 0.01] = 0
        v2[name] = x + step
    from safetensors.numpy import save_file

    for name, ts in (("v1", v1), ("v2", v2)):
        (out / name).mkdir(parents=True, exist_ok=True)
        save_file(ts, str(out / name / "model.safetensors"))
        (out / name / "config.json").write_text('{"architectures": ["SmallTensors"]}\n')


def worker(args: argparse.Namespace) -> None:
    """One timed step in this process (run with the implementation's tree on PYTHONPATH)."""
    import deltafs
    from deltafs.publish import push
    from deltafs.read.pull import pull

    opts = json.loads(args.storage_options) if args.storage_options else None
    t0 = time.perf_counter()
    if args.step == "push":
        res = push(args.store, args.src, cache_dir=args.cache, threads=args.threads, storage_options=opts)
    else:
        res = pull(args.store, args.dest, threads=args.threads, storage_options=opts)
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "result": res.to_json(), "deltafs": deltafs.__file__}))


def run_step(impl: str, step: str, store: str, threads: int, *, src: str = "", cache: str = "", dest: str = "",
             storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=impl)
    cmd = [sys.executable, os.path.abspath(__file__), "worker", "--step", step, "--store", store, "--threads",
           str(threads), "--src", src, "--cache", cache, "--dest", dest,
           "--storage-options", json.dumps(storage_options) if storage_options else ""]
    out = subprocess.run(cmd, env=env, cwd="/", check=True, capture_output=True, text=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def count_objects(store: str, storage_options: dict[str, Any] | None) -> int:
    import fsspec

    fs, path = fsspec.core.url_to_fs(store, **(storage_options or {}))
    try:
        return sum(1 for p in fs.find(path.rstrip("/") + "/chunks"))
    except FileNotFoundError:
        return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd")
    w = sub.add_parser("worker")
    for name in ("--step", "--store", "--src", "--cache", "--dest", "--storage-options"):
        w.add_argument(name, default="")
    w.add_argument("--threads", type=int, default=1)
    p.add_argument("--work", default="/tmp/small-tensors")
    p.add_argument("--tensors", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--impl", action="append", default=[], help="NAME=PATH of a deltafs tree (repeatable)")
    p.add_argument("--stores", default="local,s3")
    p.add_argument("--base", help="a checkpoint directory to use as version 1 instead of the generated one")
    p.add_argument("--new", help="the checkpoint directory of version 2 (with --base)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.cmd == "worker":
        worker(args)
        return
    impls = dict(i.split("=", 1) for i in args.impl) or {"this": str(Path(__file__).resolve().parents[1])}
    impls = {k: str(Path(v).resolve()) for k, v in impls.items()}
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    if args.base:
        (work / "data").mkdir()
        shutil.copytree(args.base, work / "data" / "v1")
        shutil.copytree(args.new, work / "data" / "v2")
        size = sum(f.stat().st_size for f in (work / "data" / "v1").iterdir())
        print(f"data: {args.base} -> {args.new}, {size / 1e6:.1f} MB", flush=True)
    else:
        make_versions(work / "data", args.tensors)
        size = (work / "data" / "v1" / "model.safetensors").stat().st_size
        print(f"data: {args.tensors} F32 tensors, {size / 1e6:.1f} MB, made in {time.perf_counter() - t0:.1f} s",
              flush=True)
    stores = args.stores.split(",")
    server = None
    if "s3" in stores:
        from deltafs.testing.s3server import start_process_server

        server = start_process_server()
    rows: list[dict[str, Any]] = []
    try:
        for rnd in range(args.rounds):
            t = time.perf_counter()
            subprocess.run(["cp", "-r", str(work / "data" / "v2"), str(work / f"cp-{rnd}")], check=True)  # noqa: S607
            rows.append({"round": rnd, "impl": "cp -r", "store": "local", "step": "copy",
                         "seconds": time.perf_counter() - t})
            shutil.rmtree(work / f"cp-{rnd}")
            for store_kind in stores:
                for name, impl in impls.items():
                    tag = f"{name}-{store_kind}-{rnd}"
                    opts = None
                    if store_kind == "s3":
                        assert server is not None
                        bucket = server.make_bucket(f"b{rnd}-{name}".lower().replace("_", "-"))
                        store, opts = f"s3://{bucket}/run", server.storage_options()
                    else:
                        store = str(work / tag / "store")
                    cache, dest = str(work / tag / "cache"), str(work / tag / "dest")
                    first = run_step(impl, "push", store, args.threads, src=str(work / "data" / "v1"), cache=cache,
                                     storage_options=opts)
                    initial = run_step(impl, "pull", store, args.threads, dest=dest, storage_options=opts)
                    assert first["result"]["kind"] == "full" and initial["result"]["version"] == 1
                    before = count_objects(store, opts)
                    pushed = run_step(impl, "push", store, args.threads, src=str(work / "data" / "v2"), cache=cache,
                                      storage_options=opts)
                    added = count_objects(store, opts) - before
                    pulled = run_step(impl, "pull", store, args.threads, dest=dest, storage_options=opts)
                    assert impl in pushed["deltafs"] and impl in pulled["deltafs"], (impl, pushed["deltafs"])
                    assert pulled["result"]["version"] == 2 and not pulled["result"].get("fallback")
                    for f in (work / "data" / "v2").iterdir():
                        assert (Path(pulled["result"]["path"]) / f.name).read_bytes() == f.read_bytes(), f.name
                    rows.append({"round": rnd, "impl": name, "store": store_kind, "step": "full push",
                                 "seconds": first["seconds"], "bytes_written": first["result"].get("bytes_written")})
                    rows.append({"round": rnd, "impl": name, "store": store_kind, "step": "full pull",
                                 "seconds": initial["seconds"]})
                    rows.append({"round": rnd, "impl": name, "store": store_kind, "step": "push",
                                 "seconds": pushed["seconds"], "objects_added": added,
                                 "bytes_written": pushed["result"].get("bytes_written")})
                    rows.append({"round": rnd, "impl": name, "store": store_kind, "step": "pull",
                                 "seconds": pulled["seconds"], "bytes_read": pulled["result"].get("bytes_read")})
                    print(f"round {rnd} {store_kind:5} {name:6} full push {first['seconds']:.3f} s, full pull "
                          f"{initial['seconds']:.3f} s; push {pushed['seconds']:.3f} s ({added} objects, "
                          f"{pushed['result'].get('bytes_written')} B)  pull {pulled['seconds']:.3f} s", flush=True)
                    shutil.rmtree(work / tag, ignore_errors=True)
    finally:
        if server is not None:
            server.stop()
    summary = []
    for store_kind in stores:
        for name in impls:
            for step in ("full push", "full pull", "push", "pull"):
                secs = [r["seconds"] for r in rows if (r["impl"], r["store"], r["step"]) == (name, store_kind, step)]
                summary.append({"impl": name, "store": store_kind, "step": step, "median_s": statistics.median(secs),
                                "min_s": min(secs), "max_s": max(secs)})
    cp = [r["seconds"] for r in rows if r["impl"] == "cp -r"]
    print("\n| store | impl | step | median s | range s | x cp -r |\n|---|---|---|---|---|---|")
    for s in summary:
        print(f"| {s['store']} | {s['impl']} | {s['step']} | {s['median_s']:.3f} | {s['min_s']:.3f}-{s['max_s']:.3f} "
              f"| {s['median_s'] / statistics.median(cp):.1f}x |")
    print(f"| local | cp -r | copy | {statistics.median(cp):.3f} | {min(cp):.3f}-{max(cp):.3f} | 1.0x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "checkpoint_bytes": size, "rows": rows,
                                               "summary": summary, "cp_median_s": statistics.median(cp)}, indent=1)
                                   + "\n")


if __name__ == "__main__":
    main()
