"""Codec benchmark: bytes per delta and one-thread encode/apply speed, deltafs against XOR + zstd-1, on two data sets.

Data sets, side by side in one run:

  generator   deltafs.testing.generator: Llama-shaped tensors, fp32 masters under a simulated AdamW, exported to
              bf16 (walked one decoder layer / embedding row block at a time so large configs fit in memory)
  trained     deltafs.testing.trained: a small GPT really trained with torch AdamW; bf16 matrices and many small
              1-D F32 tensors (LayerNorms, biases), which change almost entirely every step

Each gets one step per learning rate (--gen-lrs, --trained-lrs); the changed fraction is measured and printed.
Methods, per delta:

  full copy                 every tensor's bytes copied
  zstd-1 full               each tensor compressed with zstd level 1 (no base)
  XOR + zstd-1 per tensor   new XOR previous, one zstd-1 frame per tensor (slime's / Fireworks ARC's scheme)
  deltafs                   deltafs.codec.encode/decode per chunk (chunk_bytes, default 4 MiB), one thread
  deltafs apply in place    decode(..., out=base): the buffer holding the old bytes is patched (a pull that
                            reads the previous version into a buffer can do this; the copy is not timed)
  deltafs before             bytes only: the previous policy (trial-encode sparse, xor and raw above 10% changed)
  real push (trained only)  `deltafs.push` of the previous version, then of the new one, to a fresh local store:
                            bytes_written, chunks plus manifest (the Bytes target of issue 9)
  entropy estimate          deltafs.testing.entropy: per tensor n*H2(p) bits for the changed positions + per
                            changed element the empirical entropy of the integer bit-pattern difference

Speeds are checkpoint bytes per second of the calling thread's CPU time (time.thread_time), best of --reps,
with every method run interleaved tensor by tensor: on a shared machine CPU time is far steadier than wall
time, and all work here runs on the calling thread (numpy and zstd do not start threads of their own). Apply
starts from the previous version in memory and writes into a preallocated buffer, as a pull writes its output
file; every apply is checked byte for byte.

Run:  python benchmarks/codec_bench.py --json docs/codec_bench.json   (defaults: llama-1b, 1 layer + 4/32 of the
      embedding; trained GPT 20M; about 6 minutes on 2 shared vCPUs)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from typing import Any

import numpy as np
import torch
import zstandard

from deltafs import codec
from deltafs.testing.entropy import delta_entropy_bits
from deltafs.testing.generator import CONFIGS, ModelConfig, TrainerSim
from deltafs.testing.trained import TrainedRun, changed_fractions, config_for, parse_count

BASELINE = "XOR + zstd-1 per tensor"
OURS = "deltafs"
BEFORE = "deltafs before (trial encodes)"  # bytes only: the previous choice policy on the same chunks
IN_PLACE = "deltafs apply in place"  # decode(..., out=base): the old bytes' buffer becomes the new (no copy)
METHODS = ["full copy", "zstd-1 full", BASELINE, OURS]

Pair = tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, int]]  # (prev, new, itemsize) by name


def as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().reshape(-1)


def best(reps: int, fn: Callable[[], Any], setup: Callable[[], Any] | None = None) -> tuple[float, Any]:
    """Least thread CPU seconds of reps calls (setup, untimed, before each), and the last result."""
    low, out = float("inf"), None
    for _ in range(reps):
        if setup is not None:
            setup()
        start = time.thread_time()
        out = fn()
        low = min(low, time.thread_time() - start)
    return low, out


def measure_tensor(n: np.ndarray, o: np.ndarray, itemsize: int, args: argparse.Namespace,
                   res: dict[str, Any]) -> None:
    """Add one tensor's bytes and best times, every method, to res."""
    c1 = zstandard.ZstdCompressor(level=1)
    d1 = zstandard.ZstdDecompressor()
    out = np.empty_like(n)
    reps = args.reps

    size_class = "< 64 KiB" if n.size < 65536 else "< 1 MiB" if n.size < 1 << 20 else ">= 1 MiB"
    group = f"{itemsize}-byte elements, tensors {size_class}"

    def add(method: str, nbytes: float, enc: float, app: float) -> None:
        res[method]["bytes"] += nbytes
        res[method]["encode"] += enc
        res[method]["apply"] += app
        if method in (BASELINE, OURS):  # the same split by tensor class: where fixed per-chunk costs show
            key = f"{group}|{method}"
            res["by class"][f"{key}|encode"] += enc
            res["by class"][f"{key}|apply"] += app
            res["by class"][f"{group}|tensors"] += method == OURS

    t, _ = best(reps, lambda: np.copyto(out, n))
    add("full copy", n.size, t, t)

    t, frame = best(reps, lambda: c1.compress(n))
    ta, _ = best(reps, lambda: np.copyto(out, np.frombuffer(d1.decompress(frame), np.uint8)))
    assert out.tobytes() == n.tobytes()
    add("zstd-1 full", len(frame), t, ta)

    t, frame = best(reps, lambda: c1.compress(np.bitwise_xor(n, o)))
    ta, _ = best(reps, lambda: np.bitwise_xor(np.frombuffer(d1.decompress(frame), np.uint8), o, out=out))
    assert out.tobytes() == n.tobytes()
    add(BASELINE, len(frame), t, ta)

    spans = [(s, min(n.size, s + args.chunk_bytes)) for s in range(0, n.size, args.chunk_bytes)] or [(0, 0)]
    t, encs = best(reps, lambda: [codec.encode(n[s:e], o[s:e], itemsize, level=args.level) for s, e in spans])

    def apply() -> None:
        for (s, e), enc in zip(spans, encs, strict=True):
            codec.decode(enc.codec, enc.payload, o[s:e], e - s, itemsize, out=out[s:e])

    out[:] = 0
    ta, _ = best(reps, apply)
    assert out.tobytes() == n.tobytes(), "deltafs did not round-trip"
    add(OURS, sum(len(x.payload or b"") for x in encs), t, ta)

    def apply_in_place() -> None:
        for (s, e), enc in zip(spans, encs, strict=True):
            codec.decode(enc.codec, enc.payload, out[s:e], e - s, itemsize, out=out[s:e])

    ti, _ = best(reps, apply_in_place, setup=lambda: np.copyto(out, o))
    assert out.tobytes() == n.tobytes(), "deltafs did not round-trip in place"
    res[IN_PLACE]["apply"] += ti
    res[BEFORE]["bytes"] += sum(trial_policy_bytes(n[s:e], o[s:e], itemsize, args.level) for s, e in spans)
    for x in encs:
        res["codecs"][x.codec["name"] + (" split" if x.codec.get("split") else "")] += 1
    res["timing"]["tensors"] += 1
    res["timing"]["small tensors"] += n.size < 65536

    bits, changed = delta_entropy_bits(n, o, itemsize)
    res["entropy estimate"]["bytes"] += bits / 8
    res["totals"]["full"] += n.size
    res["totals"]["elements"] += n.size // itemsize
    res["totals"]["changed"] += changed


def trial_policy_bytes(n: np.ndarray, o: np.ndarray, itemsize: int, level: int) -> int:
    """Bytes the codec stored before it chose from statistics: sparse up to 10% changed, else the smallest of
    trial-encoded sparse, xor and raw (the same stream formats, so the comparison is of the choice alone)."""
    width = itemsize if n.size % itemsize == 0 else 1
    dtype = np.dtype(f"<u{width}")
    nw, ow = n.view(dtype), o.view(dtype)
    idx = np.flatnonzero(nw != ow)
    if idx.size == 0:
        return 0
    sizes = [len(codec.Sparse.encode(nw, ow, idx, level)[1])]
    if idx.size > 0.1 * nw.size:
        sizes += [len(codec.Xor.encode(n, o, width, level)[1]), len(codec.Raw.encode(n, width, level)[1])]
    return min(sizes)


def new_result() -> dict[str, Any]:
    return defaultdict(lambda: defaultdict(float))


def measure_pair(pair: Pair, args: argparse.Namespace, res: dict[str, Any]) -> None:
    prev, new, itemsize = pair
    for name, n in new.items():
        measure_tensor(n, prev[name], itemsize[name], args, res)


# --- data sets ---------------------------------------------------------------------------------------------------


def generator_groups(config: ModelConfig, layers: int | None, slices: int,
                     blocks: int | None = None) -> list[tuple[ModelConfig, list[str]]]:
    """(config, tensor names) to simulate together: one decoder layer at a time; the embedding and lm_head as
    `slices` row blocks of their own (same statistics, a fraction of the memory), only the first `blocks` of
    them when given; the final norm alone."""
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
            out += [(block, [key])] * (slices if blocks is None else min(blocks, slices))
        else:
            out.append((config, members))
    return out


def generator_pairs(args: argparse.Namespace, lr: float) -> Iterator[Pair]:
    config = CONFIGS[args.config]
    for gi, (gconfig, names) in enumerate(generator_groups(config, args.layers, args.embed_slices, args.embed_blocks)):
        sim = TrainerSim(gconfig, seed=1000 + gi, lr=lr, names=names)
        prev = {k: as_bytes(v) for k, v in sim.export().items()}
        new = {k: as_bytes(v) for k, v in sim.step().items()}
        yield prev, new, {k: 2 for k in new}


def push_bytes(prev_t: dict[str, torch.Tensor], new_t: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A real push of prev then new (each one safetensors file) into a fresh local store: what the delta costs on
    disk, chunks plus manifest (PushResult.bytes_written), as `deltafs push base STORE; deltafs push new STORE
    --json` reports it."""
    from safetensors.torch import save_file

    from deltafs import push

    with tempfile.TemporaryDirectory(prefix="codec-bench-push-") as tmp:
        for name, tensors in (("base", prev_t), ("new", new_t)):
            os.makedirs(os.path.join(tmp, name))
            save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(tmp, name, "model.safetensors"))
        store = os.path.join(tmp, "store")
        push(store, os.path.join(tmp, "base"))
        result = push(store, os.path.join(tmp, "new"))
        manifests = [os.path.join(d, f) for d, _, fs in os.walk(store) for f in fs if "manifest" in d + f]
    return {"bytes_written": result.bytes_written, "full_bytes": result.full_bytes, "kind": result.kind,
            "chunks_written": result.chunks_written, "manifest_files": len(manifests)}


def trained_pairs(args: argparse.Namespace, lr: float, fractions: dict[str, Any],
                  pushed: dict[str, Any]) -> Iterator[Pair]:
    run = TrainedRun(config_for(parse_count(args.params)), seed=args.seed, lr=lr)
    prev_t = run.export()
    new_t = run.step()
    fractions.update(changed_fractions(prev_t, new_t))
    if args.push_bytes:
        pushed.update(push_bytes(prev_t, new_t))
    yield ({k: as_bytes(v) for k, v in prev_t.items()}, {k: as_bytes(v) for k, v in new_t.items()},
           {k: v.element_size() for k, v in new_t.items()})


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.time()
    load_before = os.getloadavg()
    deltas: list[dict[str, Any]] = []
    plan = [("generator", lr) for lr in args.gen_lrs] + [("trained", lr) for lr in args.trained_lrs]
    for dataset, lr in plan:
        res = new_result()
        fractions: dict[str, Any] = {}
        pushed: dict[str, Any] = {}
        pairs = generator_pairs(args, lr) if dataset == "generator" else trained_pairs(args, lr, fractions, pushed)
        for pair in pairs:
            measure_pair(pair, args, res)
        print(f"[{time.time() - started:6.0f}s] {dataset} lr {lr}", file=sys.stderr)
        deltas.append({"dataset": dataset, "lr": lr, "changed_by_dtype": fractions, "push": pushed,
                       "results": {k: dict(v) for k, v in res.items()}})
    trained_cfg = config_for(parse_count(args.params))
    return {
        "generator": {"config": args.config, "layers": args.layers, "embed_slices": args.embed_slices,
                      "embed_blocks": args.embed_blocks},
        "trained": {"params": trained_cfg.num_params(), "config": asdict(trained_cfg), "seed": args.seed},
        "chunk_bytes": args.chunk_bytes,
        "level": args.level,
        "reps": args.reps,
        "timer": "time.thread_time (CPU seconds of the one thread doing the work), best of reps",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
                    "zstandard": zstandard.__version__, "loadavg_before": load_before,
                    "loadavg_after": os.getloadavg()},
        "seconds": round(time.time() - started, 1),
        "deltas": deltas,
    }


def table(report: dict[str, Any]) -> str:
    lines = []
    for d in report["deltas"]:
        res = d["results"]
        tot = res["totals"]
        full = tot["full"]
        frac = tot["changed"] / tot["elements"]
        base = res[BASELINE]
        ent = res["entropy estimate"]["bytes"]
        by_dtype = ", ".join(f"{k} {100 * v:.2f}%" for k, v in d["changed_by_dtype"].items() if k != "all")
        lines.append(f"\n### {d['dataset']}, lr {d['lr']:g}: {frac * 100:.2f}% of elements changed"
                     f"{' (' + by_dtype + ')' if by_dtype else ''}; {full / 1e6:.1f} MB,"
                     f" {int(res['timing']['tensors'])} tensors ({int(res['timing']['small tensors'])} under 64 KiB)\n")
        lines.append("| method | bytes stored | % of full | vs XOR+zstd-1 | vs entropy | encode GB/s | apply GB/s |"
                     " encode vs XOR+zstd-1 | apply vs XOR+zstd-1 |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for m in METHODS:
            r = res[m]
            bold = "**" if m == OURS else ""
            lines.append(f"| {bold}{m}{bold} | {r['bytes'] / 1e6:,.3f} MB | {100 * r['bytes'] / full:.3f}% |"
                         f" {r['bytes'] / base['bytes']:.3f}x | {r['bytes'] / ent:.3f}x |"
                         f" {full / r['encode'] / 1e9:.2f} | {full / r['apply'] / 1e9:.2f} |"
                         f" {bold}{base['encode'] / r['encode']:.2f}x{bold} | {bold}{base['apply'] / r['apply']:.2f}x{bold} |")
        r = res[BEFORE]
        lines.append(f"| {BEFORE} | {r['bytes'] / 1e6:,.3f} MB | {100 * r['bytes'] / full:.3f}% |"
                     f" {r['bytes'] / base['bytes']:.3f}x | {r['bytes'] / ent:.3f}x | | | | |")
        r = res[IN_PLACE]
        lines.append(f"| {IN_PLACE} | | | | | | {full / r['apply'] / 1e9:.2f} | | {base['apply'] / r['apply']:.2f}x |")
        lines.append(f"| entropy estimate | {ent / 1e6:,.3f} MB | {100 * ent / full:.3f}% | {ent / base['bytes']:.3f}x"
                     f" | 1.000x | | | | |")
        kinds = ", ".join(f"{k}: {int(v)}" for k, v in sorted(res["codecs"].items()))
        lines.append(f"\ndeltafs chunks by codec: {kinds}")
        cls = res.get("by class", {})
        groups = sorted({k.split("|")[0] for k in cls})
        if len(groups) > 1:
            lines.append("\n| tensors | XOR+zstd-1 encode / apply (ms) | deltafs encode / apply (ms) | encode / apply vs XOR+zstd-1 |")
            lines.append("|---|---:|---:|---:|")
            for g in groups:
                xe, xa = cls[f"{g}|{BASELINE}|encode"], cls[f"{g}|{BASELINE}|apply"]
                de, da = cls[f"{g}|{OURS}|encode"], cls[f"{g}|{OURS}|apply"]
                lines.append(f"| {int(cls[g + '|tensors'])} x {g} | {xe * 1e3:.2f} / {xa * 1e3:.2f} |"
                             f" {de * 1e3:.2f} / {da * 1e3:.2f} | {xe / de:.2f}x / {xa / da:.2f}x |")
        pushed = d.get("push")
        if pushed:
            written = pushed["bytes_written"]
            lines.append(f"\nReal push of this step (`deltafs push` base, then new; {pushed['kind']} version, "
                         f"{pushed['chunks_written']} chunks): bytes_written {written:,} (chunks + manifest) ="
                         f" **{written / ent:.3f}x the entropy estimate**, {written / base['bytes']:.3f}x XOR + zstd-1;"
                         f" codec payloads alone {res[OURS]['bytes'] / ent:.3f}x.")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llama-1b", choices=sorted(CONFIGS), help="generator model shapes")
    ap.add_argument("--layers", type=int, default=1, help="generator: only the first N decoder layers")
    ap.add_argument("--embed-slices", type=int, default=32, help="generator: simulate the embedding as row blocks")
    ap.add_argument("--embed-blocks", type=int, default=4, help="generator: measure only this many of those blocks")
    ap.add_argument("--gen-lrs", type=float, nargs="*", default=[1.75e-7, 9e-7, 2.3e-6],
                    help="generator: one step at each (llama-1b: about 0.5%%, 2%%, 5%% of elements changed)")
    ap.add_argument("--params", default="20M", help="trained data set: model size, e.g. 20M")
    ap.add_argument("--trained-lrs", type=float, nargs="*", default=[3e-7, 1e-6, 4e-6],
                    help="trained data set: one step at each (20M: about 0.8%%, 1.6%%, 5%% of elements changed)")
    ap.add_argument("--seed", type=int, default=0, help="trained data set seed")
    ap.add_argument("--chunk-bytes", type=int, default=4 << 20)
    ap.add_argument("--level", type=int, default=codec.DEFAULT_LEVEL, help="zstd level deltafs uses")
    ap.add_argument("--reps", type=int, default=3, help="timing repetitions per measurement (least CPU time kept)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for making the data sets")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    ap.add_argument("--no-push-bytes", dest="push_bytes", action="store_false",
                    help="skip the real push of each trained step (bytes_written including the manifest)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    report = run(args)
    m = report["machine"]
    print(f"# codec alone, one thread: generator {args.config} ({args.layers} layers), trained GPT "
          f"{report['trained']['params'] / 1e6:.1f}M params; chunk {args.chunk_bytes >> 20} MiB, zstd level "
          f"{args.level}, best of {args.reps} (thread CPU time), load {m['loadavg_before'][0]:.1f}->"
          f"{m['loadavg_after'][0]:.1f}, {report['seconds']} s")
    print(table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
