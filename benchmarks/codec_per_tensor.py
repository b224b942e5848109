"""Per-tensor probe: one-thread encode/apply CPU time of deltafs against XOR + zstd-1, one tensor of each kind.

Shows where fixed per-chunk costs dominate: on the trained data set (deltafs.testing.trained) it takes the first
tensor of every name pattern (the layer-0 biases and norms, each matrix kind, embeddings) from one AdamW step.

Run:  python benchmarks/codec_per_tensor.py --params 20M --lr 1e-6
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import zstandard

from deltafs import codec
from deltafs.testing.trained import TrainedRun, config_for, parse_count


def least_us(fn: Callable[[], Any], reps: int) -> float:
    low = float("inf")
    for _ in range(reps):
        start = time.thread_time()
        fn()
        low = min(low, time.thread_time() - start)
    return low * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="20M")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    run = TrainedRun(config_for(parse_count(args.params)), lr=args.lr)
    old, new = run.export(), run.step()
    c1, d1 = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    seen: set[str] = set()
    print("| tensor | bytes | changed | codec | XOR+zstd-1 encode / apply (µs) | deltafs encode / apply (µs) |")
    print("|---|---:|---:|---|---:|---:|")
    for name, t in new.items():
        kind = re.sub(r"\.\d+\.", ".N.", name)
        if kind in seen:
            continue
        seen.add(kind)
        n = t.contiguous().view(torch.uint8).numpy().reshape(-1)[: 4 << 20]
        o = old[name].contiguous().view(torch.uint8).numpy().reshape(-1)[: 4 << 20]
        w = t.element_size()
        out = np.empty_like(n)
        frame = c1.compress(np.bitwise_xor(n, o))
        enc = codec.encode(n, o, w)
        xe = least_us(lambda: c1.compress(np.bitwise_xor(n, o)), args.reps)
        xa = least_us(lambda: np.bitwise_xor(np.frombuffer(d1.decompress(frame), np.uint8), o, out=out), args.reps)
        de = least_us(lambda: codec.encode(n, o, w), args.reps)
        da = least_us(lambda: codec.decode(enc.codec, enc.payload, o, n.size, w, out=out), args.reps)
        assert out.tobytes() == n.tobytes()
        print(f"| {kind} ({str(t.dtype).removeprefix('torch.')}) | {n.size:,} | {enc.changed / (n.size // w):.1%} |"
              f" {enc.codec['name']} | {xe:.0f} / {xa:.0f} | {de:.0f} / {da:.0f} |")


if __name__ == "__main__":
    main()
