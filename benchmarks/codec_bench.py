"""Codec benchmark: bytes stored per delta and encode/apply speed, deltafs against the usual baselines.

On the same generated trainer versions (deltafs.testing.generator: Llama-shaped model, fp32 masters under AdamW,
exported to bf16) it measures, per delta:

  full copy                     every tensor's bytes copied
  zstd-1 full                   each tensor compressed with zstd level 1 (no base)
  XOR + zstd-1 per tensor       new XOR previous, one zstd-1 frame per tensor (slime's / Fireworks ARC's scheme)
  deltafs 1 thread / 2 threads  deltafs.codec.encode/decode per chunk (chunk_bytes, default 4 MiB)
  entropy estimate              per tensor n*H2(p) bits for the changed positions + per changed element the
                                empirical entropy of the integer bit-pattern difference (first order, i.i.d.)

Encode GB/s and apply GB/s are full-checkpoint bytes per second of wall time. Apply writes into a preallocated
output buffer (as a pull writes into its output file) and starts from the previous version's bytes in memory.
The model is walked a few tensors at a time (one decoder layer, or the embedding) with a fresh simulator per
group, so the 1B configuration fits in a few GB; each group runs one step at each learning rate.

Run:  python benchmarks/codec_bench.py --config llama-1b --lrs 1.75e-7 9e-7 --json docs/codec_bench.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import zstandard

from deltafs import codec
from deltafs.testing.entropy import delta_entropy_bits
from deltafs.testing.generator import CONFIGS, ModelConfig, TrainerSim

METHODS = ["full copy", "zstd-1 full", "XOR + zstd-1 per tensor", "deltafs (1 thread)", "deltafs (2 threads)",
           f"deltafs level {codec.SPLIT_LEVEL}, split (1 thread)"]


def as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().reshape(-1)


class Timer:
    """Best of `reps` wall times per call site (the machine is shared; the minimum is the least disturbed)."""

    def __init__(self, reps: int) -> None:
        self.reps = reps

    def best(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        best, out = float("inf"), None
        for _ in range(self.reps):
            start = time.perf_counter()
            out = fn()
            best = min(best, time.perf_counter() - start)
        return best, out


def chunks(size: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(size, s + chunk)) for s in range(0, size, chunk)]


def measure_tensor(n: np.ndarray, o: np.ndarray, args: argparse.Namespace, timer: Timer,
                   res: dict[str, dict[str, float]]) -> None:
    """Add one tensor's bytes and best times, for the per-tensor baselines, to res."""
    c1 = zstandard.ZstdCompressor(level=1)
    d1 = zstandard.ZstdDecompressor()
    out = np.empty_like(n)

    # full copy
    t, _ = timer.best(lambda: np.copyto(out, n))
    res["full copy"]["bytes"] += n.size
    res["full copy"]["encode"] += t
    res["full copy"]["apply"] += t

    # zstd-1 of the full tensor
    t, frame = timer.best(lambda: c1.compress(n))
    res["zstd-1 full"]["bytes"] += len(frame)
    res["zstd-1 full"]["encode"] += t
    t, _ = timer.best(lambda: np.copyto(out, np.frombuffer(d1.decompress(frame), np.uint8)))
    assert out.tobytes() == n.tobytes()
    res["zstd-1 full"]["apply"] += t

    # XOR + zstd-1, one frame per tensor
    t, frame = timer.best(lambda: c1.compress(np.bitwise_xor(n, o)))
    res["XOR + zstd-1 per tensor"]["bytes"] += len(frame)
    res["XOR + zstd-1 per tensor"]["encode"] += t
    t, _ = timer.best(lambda: np.bitwise_xor(np.frombuffer(d1.decompress(frame), np.uint8), o, out=out))
    assert out.tobytes() == n.tobytes()
    res["XOR + zstd-1 per tensor"]["apply"] += t



# One work item of deltafs: (new tensor, old tensor, output buffer, start, end) of a chunk.
Item = tuple[np.ndarray, np.ndarray, np.ndarray, int, int]


def run_deltafs(items: list[Item], level: int, pool: ThreadPoolExecutor | None,
                timer: Timer) -> tuple[list[codec.Encoded], float, float]:
    """Encode every chunk, then apply them all into their output buffers; (encoded chunks, best times).

    All chunks of a group go to the pool at once, as a pusher streaming through a checkpoint would submit them.
    """

    def enc_one(item: Item) -> codec.Encoded:
        n, o, _, s, e = item
        return codec.encode(n[s:e], o[s:e], 2, level=level)

    def apply_one(pair: tuple[Item, codec.Encoded]) -> None:
        (_, o, out, s, e), enc = pair
        out[s:e] = codec.decode(enc.codec, enc.payload, o[s:e], e - s, 2)

    t_enc, encs = timer.best(lambda: [enc_one(it) for it in items] if pool is None else list(pool.map(enc_one, items)))
    pairs = list(zip(items, encs))
    t_apply, _ = timer.best(lambda: [apply_one(p) for p in pairs] if pool is None else list(pool.map(apply_one, pairs)))
    return encs, t_enc, t_apply


def measure_group(prev: dict[str, np.ndarray], new: dict[str, np.ndarray], args: argparse.Namespace,
                  pool: ThreadPoolExecutor, timer: Timer) -> dict[str, dict[str, float]]:
    """Bytes, encode seconds and apply seconds of every method on one group of tensors."""
    res: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    items: list[Item] = []
    for name, n in new.items():
        out = np.empty_like(n)
        items += [(n, prev[name], out, s, e) for s, e in chunks(n.size, args.chunk_bytes)]
    # deltafs, per chunk, 1 and 2 threads, default level and split level
    runs = [("deltafs (1 thread)", None, args.level), ("deltafs (2 threads)", pool, args.level),
            (METHODS[-1], None, max(args.level, codec.SPLIT_LEVEL))]
    for label, threads, level in runs:
        encs, t_enc, t_apply = run_deltafs(items, level, threads, timer)
        assert all(np.array_equal(out[s:e], n[s:e]) for n, _, out, s, e in items), f"{label} did not round-trip"
        res[label]["bytes"] += sum(len(e.payload or b"") for e in encs)
        res[label]["encode"] += t_enc
        res[label]["apply"] += t_apply
        if threads is None:
            for e in encs:
                res["codecs " + label][e.codec["name"] + (" split" if e.codec.get("split") else "")] += 1
    for name, n in new.items():
        measure_tensor(n, prev[name], args, timer, res)
        bits, changed = delta_entropy_bits(n, prev[name], 2)
        res["entropy estimate"]["bytes"] += bits / 8
        res["totals"]["full"] += n.size
        res["totals"]["elements"] += n.size // 2
        res["totals"]["changed"] += changed
    return res


def groups_of(config: ModelConfig, layers: int | None, slices: int) -> list[tuple[ModelConfig, list[str]]]:
    """(config, tensor names) to simulate together: one decoder layer at a time; the embedding and lm_head as
    `slices` row blocks of their own (same statistics, a fraction of the memory); the final norm alone."""
    groups: dict[str, list[str]] = {}
    for name in config.shapes():
        key = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else name
        if key.startswith("model.layers.") and layers is not None and int(key.split(".")[2]) >= layers:
            continue
        groups.setdefault(key, []).append(name)
    out: list[tuple[ModelConfig, list[str]]] = []
    for key, members in groups.items():
        if key in ("model.embed_tokens.weight", "lm_head.weight") and slices > 1:
            block = replace(config, vocab_size=config.vocab_size // slices, num_layers=0)
            out += [(block, [key])] * slices
        else:
            out.append((config, members))
    return out


def merge(total: dict[str, dict[str, float]], part: dict[str, dict[str, float]]) -> None:
    for k, v in part.items():
        for kk, vv in v.items():
            total.setdefault(k, {}).setdefault(kk, 0.0)
            total[k][kk] += vv


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = CONFIGS[args.config]
    groups = groups_of(config, args.layers, args.embed_slices)
    timer = Timer(args.reps)
    results: dict[float, dict[str, dict[str, float]]] = {lr: {} for lr in args.lrs}
    started = time.time()
    load_before = os.getloadavg()
    with ThreadPoolExecutor(max_workers=2) as pool:
        for gi, (gconfig, names) in enumerate(groups):
            sim = TrainerSim(gconfig, seed=1000 + gi, lr=args.lrs[0], names=names)
            prev = {k: as_bytes(v) for k, v in sim.export().items()}
            for lr in args.lrs:
                sim.lr = lr
                new = {k: as_bytes(v) for k, v in sim.step().items()}
                merge(results[lr], measure_group(prev, new, args, pool, timer))
                prev = new
            del sim
            print(f"[{time.time() - started:6.0f}s] group {gi + 1}/{len(groups)} {names[0]}", file=sys.stderr)
    return {
        "config": config.name,
        "layers": args.layers if args.layers is not None else config.num_layers,
        "params": sum(math.prod(c.shapes()[n]) for c, g in groups for n in g),
        "embed_slices": args.embed_slices,
        "chunk_bytes": args.chunk_bytes,
        "level": args.level,
        "reps": args.reps,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
                    "zstandard": zstandard.__version__, "loadavg_before": load_before,
                    "loadavg_after": os.getloadavg()},
        "seconds": round(time.time() - started, 1),
        "deltas": {str(lr): res for lr, res in results.items()},
    }


def table(report: dict[str, Any]) -> str:
    lines = []
    for lr, res in report["deltas"].items():
        tot = res["totals"]
        full = tot["full"]
        frac = tot["changed"] / tot["elements"]
        xor = res["XOR + zstd-1 per tensor"]["bytes"]
        ent = res["entropy estimate"]["bytes"]
        lines.append(f"\n### lr = {lr}: {frac * 100:.2f}% of bf16 elements changed ({full / 1e9:.2f} GB checkpoint)\n")
        lines.append("| method | bytes stored | % of full | vs XOR+zstd-1 | vs entropy | encode GB/s | apply GB/s |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|")
        for m in METHODS:
            r = res[m]
            lines.append(f"| {m} | {r['bytes'] / 1e6:,.2f} MB | {100 * r['bytes'] / full:.3f}% | {r['bytes'] / xor:.3f}x"
                         f" | {r['bytes'] / ent:.3f}x | {full / r['encode'] / 1e9:.2f} | {full / r['apply'] / 1e9:.2f} |")
        lines.append(f"| entropy estimate | {ent / 1e6:,.2f} MB | {100 * ent / full:.3f}% | {ent / xor:.3f}x | 1.000x | | |")
        for key in sorted(k for k in res if k.startswith("codecs ")):
            kinds = ", ".join(f"{k}: {int(v)}" for k, v in sorted(res[key].items()))
            lines.append(f"\nchunks by codec, {key[7:]}: {kinds}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llama-1b", choices=sorted(CONFIGS))
    ap.add_argument("--layers", type=int, default=None, help="only the first N decoder layers (default: all)")
    ap.add_argument("--lrs", type=float, nargs="+", default=[1.75e-7, 9e-7],
                    help="one step at each learning rate, in order (llama-1b: 1.75e-7 ~ 0.5%%, 9e-7 ~ 2%% changed)")
    ap.add_argument("--embed-slices", type=int, default=8, help="simulate the embedding as this many row blocks")
    ap.add_argument("--chunk-bytes", type=int, default=4 << 20)
    ap.add_argument("--level", type=int, default=codec.DEFAULT_LEVEL, help="zstd level deltafs uses")
    ap.add_argument("--reps", type=int, default=2, help="timing repetitions per measurement (best is kept)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the simulator")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    report = run(args)
    print(f"# {report['config']} ({report['layers']} layers, {report['params'] / 1e9:.3f}B params), "
          f"chunk {args.chunk_bytes >> 20} MiB, zstd level {args.level}, best of {args.reps}, "
          f"load {report['machine']['loadavg_before'][0]:.1f}->{report['machine']['loadavg_after'][0]:.1f}, "
          f"{report['seconds']} s")
    print(table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
