"""Scale benchmark: ~1B bf16 parameters, N versions, pushed to and pulled from a local path and an S3 server.

    python benchmarks/scale_bench.py run --work /tmp/scale --config llama-1b --versions 10 --out docs/scale.json

Phases, each push and pull in its own subprocess so its peak RSS (ru_maxrss) is its own:
  1. generate: TrainerSim (deltafs.testing.generator) exports N consecutive bf16 versions to disk
     (the simulator needs ~12 bytes per parameter; it exits before anything is measured);
  2. push:     every version to each store (local path; moto's S3 server in its own process);
  3. pull:     a cold pull of the newest version, an update from the one before it, and P concurrent
               pullers of the newest version (cold, each into its own DEST), every DEST checked
               byte-for-byte against the source's sha256s.
Results go to --out (JSON) and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

GiB = 1 << 30


# --- workers (run as subprocesses) ---------------------------------------------------------
def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def worker_generate(args: argparse.Namespace) -> dict[str, Any]:
    from deltafs.testing.generator import CONFIGS, TrainerSim, write_checkpoint

    config = CONFIGS[args.config]
    if args.layers:
        config = config.with_layers(args.layers)
    sim = TrainerSim(config, seed=0, lr=args.lr)
    out = Path(args.src)
    digests: dict[str, dict[str, str]] = {}
    t0 = time.monotonic()
    for step in range(1, args.versions + 1):
        tensors = sim.step()
        path = out / f"v{step:04d}"
        write_checkpoint(path, tensors, config, step=step, shard_bytes=args.shard_bytes)
        del tensors
        digests[path.name] = tree_digests(path)
    info = {"params": config.num_params(), "config": config.name, "lr": args.lr, "seconds": time.monotonic() - t0,
            "max_rss": _maxrss_bytes()}
    (out / "generate.json").write_text(json.dumps(info))
    (out / "digests.json").write_text(json.dumps(digests, indent=1))
    return info


def worker_push(args: argparse.Namespace) -> dict[str, Any]:
    from deltafs.publish import push

    t0 = time.monotonic()
    res = push(args.store, args.src, storage_options=json.loads(args.options), cache_dir=args.cache)
    return {"seconds": time.monotonic() - t0, "max_rss": _maxrss_bytes(), **res.to_json()}


def worker_pull(args: argparse.Namespace) -> dict[str, Any]:
    from deltafs.read.pull import pull

    t0 = time.monotonic()
    res = pull(args.store, args.dest, version=args.version, storage_options=json.loads(args.options), keep=1)
    seconds = time.monotonic() - t0
    rss = _maxrss_bytes()
    identical = None
    if args.expect:
        expected = json.loads(Path(args.expect).read_text())[f"v{res.version:04d}"]
        identical = tree_digests(Path(args.dest)) == expected
    return {"seconds": seconds, "max_rss": rss, "identical": identical, **res.to_json()}


def tree_digests(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h = hashlib.sha256()
            with open(p, "rb") as fh:
                for block in iter(lambda: fh.read(8 << 20), b""):
                    h.update(block)
            out[str(p.relative_to(root))] = h.hexdigest()
    return out


# --- orchestration ---------------------------------------------------------------------------
def spawn(*argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, __file__, "worker", *argv], stdout=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"worker failed with exit code {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def run_worker(*argv: str) -> dict[str, Any]:
    return finish(spawn(*argv))


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def vm_hwm(pid: int) -> int:
    """Peak RSS of another process (moto's server), from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def run(args: argparse.Namespace) -> None:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    src = work / "src"
    results: dict[str, Any] = {"machine": machine(), "args": {k: v for k, v in vars(args).items() if k != "func"}}
    if not (src / "digests.json").exists():
        print(f"generating {args.versions} versions of {args.config} …", file=sys.stderr)
        results["generate"] = run_worker("generate", "--config", args.config, "--layers", str(args.layers or 0),
                                         "--versions", str(args.versions), "--lr", str(args.lr), "--src", str(src),
                                         "--shard-bytes", str(args.shard_bytes))
    results["generate"] = json.loads((src / "generate.json").read_text())
    versions = sorted(p for p in src.iterdir() if p.is_dir())
    results["full_bytes"] = du(versions[-1])
    expect = str(src / "digests.json")

    from deltafs.testing.s3server import start_process_server

    server = start_process_server()
    try:
        bucket = server.make_bucket("scale-bench")
        stores = {"local": (str(work / "store-local"), {})}
        if "s3" in args.stores:
            stores["s3"] = (f"s3://{bucket}/run1", server.storage_options())
        stores = {k: v for k, v in stores.items() if k in args.stores}
        for name, (url, options) in stores.items():
            results[name] = bench_store(name, url, options, versions, work, expect, args)
            Path(args.out).write_text(json.dumps(results, indent=1))  # partial results survive a later failure
        results["s3_server_peak_rss"] = vm_hwm(server._process.pid) if server._process else None
    finally:
        server.stop()
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(markdown(results))


def bench_store(name: str, url: str, options: dict[str, Any], versions: list[Path], work: Path, expect: str,
                args: argparse.Namespace) -> dict[str, Any]:
    opts = json.dumps(options)
    cache = work / f"push-cache-{name}"
    pushes = []
    for v in versions:
        print(f"[{name}] push {v.name}", file=sys.stderr)
        pushes.append(run_worker("push", "--store", url, "--src", str(v), "--options", opts, "--cache", str(cache)))
    shutil.rmtree(cache, ignore_errors=True)
    out: dict[str, Any] = {"url": url, "pushes": pushes}
    print(f"[{name}] pushed: " + ", ".join(f"v{p['version']} {p['kind']} {p['bytes_written']} B {p['seconds']:.1f}s"
                                        for p in pushes), file=sys.stderr)
    if name == "local":
        out["store_bytes"] = du(Path(url))
    newest = len(versions)
    dest = work / f"dest-{name}"
    print(f"[{name}] cold pull v{newest}", file=sys.stderr)
    out["cold_pull"] = run_worker("pull", "--store", url, "--dest", str(dest), "--version", str(newest),
                                  "--options", opts, "--expect", expect)
    _rm_dest(dest)
    print(f"[{name}] pull v{newest - 1} then update to v{newest}", file=sys.stderr)
    run_worker("pull", "--store", url, "--dest", str(dest), "--version", str(newest - 1), "--options", opts)
    out["update_pull"] = run_worker("pull", "--store", url, "--dest", str(dest), "--version", str(newest),
                                    "--options", opts, "--expect", expect)
    _rm_dest(dest)
    if args.pullers:
        print(f"[{name}] {args.pullers} concurrent cold pullers of v{newest}", file=sys.stderr)
        dests = [work / f"fleet-{name}-{i}" for i in range(args.pullers)]
        t0 = time.monotonic()
        procs = [spawn("pull", "--store", url, "--dest", str(d), "--version", str(newest), "--options", opts,
                       "--expect", expect) for d in dests]
        each = [finish(p) for p in procs]
        out["concurrent_pull"] = {"pullers": args.pullers, "wall_seconds": time.monotonic() - t0, "each": each}
        for d in dests:
            _rm_dest(d)
    return out


def _rm_dest(dest: Path) -> None:
    if dest.is_symlink():
        dest.unlink()
    shutil.rmtree(str(dest) + ".deltafs", ignore_errors=True)
    shutil.rmtree(dest, ignore_errors=True)


def machine() -> dict[str, Any]:
    mem = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem = int(line.split()[1]) * 1024
    return {"cpus": os.cpu_count(), "mem_bytes": mem, "python": sys.version.split()[0]}


# --- report -------------------------------------------------------------------------------------
def _gb(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / (1 << 20):.1f} MiB"


def markdown(r: dict[str, Any]) -> str:
    gen = r.get("generate", {})
    params = gen.get("params", 0)
    count = f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.1f}M"
    lines = [f"Model: {gen.get('config', '?')}, {count} parameters, lr {gen.get('lr')}, "
             f"bf16 checkpoint {_gb(r['full_bytes'])}; machine: {r['machine']['cpus']} CPUs, "
             f"{r['machine']['mem_bytes'] / GiB:.0f} GiB RAM.", ""]
    for name in ("local", "s3"):
        s = r.get(name)
        if not s:
            continue
        lines += [f"### {name} ({s['url']})", "",
                  "| version | kind | bytes written | % of full | changed | push wall s | push MB/s | push peak RSS |",
                  "|---|---|---|---|---|---|---|---|"]
        for p in s["pushes"]:
            lines.append(f"| {p['version']} | {p['kind']} | {_gb(p['bytes_written'])} | "
                         f"{100 * p['bytes_written'] / p['full_bytes']:.2f}% | {100 * p['changed_fraction']:.2f}% | "
                         f"{p['seconds']:.1f} | {p['full_bytes'] / p['seconds'] / 1e6:.0f} | {_gb(p['max_rss'])} |")
        lines += ["", "| pull | bytes read | wall s | peak RSS | byte-identical |", "|---|---|---|---|---|"]
        for label, key in (("cold (newest version from nothing)", "cold_pull"), ("update (previous → newest)", "update_pull")):
            p = s[key]
            lines.append(f"| {label} | {_gb(p['bytes_read'])} | {p['seconds']:.1f} | {_gb(p['max_rss'])} | {p['identical']} |")
        c = s.get("concurrent_pull")
        if c:
            secs = sorted(e["seconds"] for e in c["each"])
            lines.append(f"| {c['pullers']} concurrent cold pullers | {_gb(sum(e['bytes_read'] for e in c['each']))} total | "
                         f"{c['wall_seconds']:.1f} all (each {secs[0]:.1f}–{secs[-1]:.1f}) | "
                         f"{_gb(max(e['max_rss'] for e in c['each']))} max each | "
                         f"{all(e['identical'] for e in c['each'])} |")
        lines.append("")
    if r.get("s3_server_peak_rss"):
        lines.append(f"moto S3 server peak RSS: {_gb(r['s3_server_peak_rss'])}.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(required=True)
    p = sub.add_parser("run", help="the whole benchmark")
    p.add_argument("--work", required=True, help="scratch directory (needs ~N+10 checkpoint sizes of disk)")
    p.add_argument("--config", default="llama-1b", help="generator config: tiny, small, llama-1b")
    p.add_argument("--layers", type=int, default=0, help="cut the model to this many decoder layers (0: all)")
    p.add_argument("--versions", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-6, help="generator learning rate (1e-6: ~1%% of elements change)")
    p.add_argument("--shard-bytes", type=int, default=1 << 30)
    p.add_argument("--stores", default="local,s3")
    p.add_argument("--pullers", type=int, default=8)
    p.add_argument("--out", default="scale.json")
    p.set_defaults(func=run)
    w = sub.add_parser("worker", help="internal: one measured step in its own process")
    wsub = w.add_subparsers(required=True)
    g = wsub.add_parser("generate")
    g.add_argument("--config")
    g.add_argument("--layers", type=int)
    g.add_argument("--versions", type=int)
    g.add_argument("--lr", type=float)
    g.add_argument("--src")
    g.add_argument("--shard-bytes", type=int)
    g.set_defaults(func=lambda a: print(json.dumps(worker_generate(a))))
    pu = wsub.add_parser("push")
    for opt in ("--store", "--src", "--options", "--cache"):
        pu.add_argument(opt)
    pu.set_defaults(func=lambda a: print(json.dumps(worker_push(a))))
    pl = wsub.add_parser("pull")
    for opt in ("--store", "--dest", "--options", "--expect"):
        pl.add_argument(opt)
    pl.add_argument("--version", type=int)
    pl.set_defaults(func=lambda a: print(json.dumps(worker_pull(a))))
    args = parser.parse_args()
    if args.func is run:
        args.stores = args.stores.split(",")
    args.func(args)


if __name__ == "__main__":
    main()
