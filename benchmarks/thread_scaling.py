"""Codec encode/apply throughput on 1 vs N threads, on synthetic bf16 chunks (1% of elements changed by ±1 ulp).

Usage: python benchmarks/thread_scaling.py [--threads 2] [--chunks 16] [--reps 3]
Each chunk is 4 MiB, the store default. Reports the best of --reps runs for each setting.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from deltafs import codec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--changed", type=float, default=0.01)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    n = 2 << 20  # bf16 elements in a 4 MiB chunk
    chunks = []
    for _ in range(args.chunks):
        base = rng.integers(0, 65536, n, dtype=np.uint16)
        new = base.copy()
        idx = rng.choice(n, int(n * args.changed), replace=False)
        new[idx] += rng.choice(np.array([1, 65535], dtype=np.uint16), idx.size)  # one ulp up or down
        chunks.append((new.view(np.uint8), base.view(np.uint8)))
    encoded = [codec.encode(a, b, 2) for a, b in chunks]
    for (a, b), e in zip(chunks, encoded, strict=True):
        assert np.array_equal(codec.decode(e.codec, e.payload, b, a.size, 2), a)

    def enc(i: int) -> object:
        return codec.encode(chunks[i][0], chunks[i][1], 2)

    def dec(i: int) -> object:
        return codec.decode(encoded[i].codec, encoded[i].payload, chunks[i][1], chunks[i][0].size, 2)

    gb = args.chunks * 4 / 1024
    print(f"{args.chunks} chunks of 4 MiB, {args.changed:.1%} changed; best of {args.reps}")
    for name, fn in (("encode", enc), ("apply", dec)):
        speeds = {}
        for threads in (1, args.threads):
            best = float("inf")
            with ThreadPoolExecutor(threads) as pool:
                for _ in range(args.reps):
                    t = time.perf_counter()
                    list(pool.map(fn, range(args.chunks)))
                    best = min(best, time.perf_counter() - t)
            speeds[threads] = gb / best
        print(f"{name}: 1 thread {speeds[1]:.2f} GB/s, {args.threads} threads {speeds[args.threads]:.2f} GB/s, "
              f"{speeds[args.threads] / speeds[1]:.2f}x")


if __name__ == "__main__":
    main()
