"""Is the GIL what limits deltafs's thread scaling? The codec's per-chunk work in N threads against N processes.

    python benchmarks/gil_check.py --base BASE.safetensors --new NEW.safetensors --workers 1,2,4,8,16

push and pull run each chunk's work (compare and encode; decode in place) on a thread pool, in numpy, zstd and
xxhash calls that release the GIL, with some Python between them that holds it. This takes the chunks of one
safetensors file pair (every tensor cut into 4 MiB chunks, as a store does), holds them in memory, and times
encoding every chunk against its base, then decoding every payload back onto a copy of its base, split over N
threads of one process and over N forked processes (which share no GIL). Where threads scale much worse than
processes, the GIL is the limit; where both stop at the same N, it is the machine (memory bandwidth, cores).
The decoded bytes are compared with the new file's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time
from typing import Any

import numpy as np

from deltafs import codec
from deltafs.format.dtypes import DTYPE_SIZES
from deltafs.testing.checkpoints import safetensors_layout

CHUNK = 4 << 20


def chunks_of(path: str) -> list[tuple[int, int, int]]:
    """(offset, size, itemsize) of every 4 MiB piece of every tensor of a safetensors file."""
    return [(offset + start, min(CHUNK, nb - start), DTYPE_SIZES[dtype])
            for dtype, offset, nb in safetensors_layout(path).values() for start in range(0, nb, CHUNK)]


def load(path: str, pieces: list[tuple[int, int, int]]) -> list[np.ndarray]:
    fd = os.open(path, os.O_RDONLY)
    try:
        return [np.frombuffer(os.pread(fd, size, off), dtype=np.uint8) for off, size, _ in pieces]
    finally:
        os.close(fd)


# Filled before the workers start; forked processes see them without copying (copy-on-write).
BASE: list[np.ndarray] = []
NEW: list[np.ndarray] = []
ITEM: list[int] = []
ENCODED: list[codec.Encoded] = []


def encode_part(part: list[int]) -> None:
    for k in part:
        codec.encode(NEW[k], BASE[k], ITEM[k])


def decode_part(part: list[int]) -> None:
    buf = np.empty(CHUNK, dtype=np.uint8)
    for k in part:
        e = ENCODED[k]
        out = buf[:BASE[k].size]
        np.copyto(out, BASE[k])
        codec.decode(e.codec, e.payload, out, out.size, ITEM[k], out=out)


def _worker(fn: Any, part: list[int], barrier: Any, times: Any, slot: int) -> None:
    fn(part[:1])  # warm this worker's heap (a forked process's first temporaries fault in fresh pages)
    barrier.wait()
    times[2 * slot] = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
    fn(part)
    times[2 * slot + 1] = time.perf_counter()


def timed(fn: Any, n: int, how: str) -> float:
    """Wall seconds from the first worker's start to the last one's end, after each has warmed up."""
    parts = [list(range(i, len(BASE), n)) for i in range(n)]
    if how == "threads":
        barrier: Any = threading.Barrier(n)
        times: Any = [0.0] * (2 * n)
        workers: list[Any] = [threading.Thread(target=_worker, args=(fn, p, barrier, times, i))
                              for i, p in enumerate(parts)]
    else:
        ctx = mp.get_context("fork")
        barrier, times = ctx.Barrier(n), ctx.Array("d", 2 * n, lock=False)
        workers = [ctx.Process(target=_worker, args=(fn, p, barrier, times, i)) for i, p in enumerate(parts)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
        if how == "processes" and w.exitcode != 0:
            raise SystemExit(f"a worker process failed (exit {w.exitcode})")
    return max(times[1::2]) - min(times[0::2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--repeat", type=int, default=3, help="runs per cell; the fastest is kept")
    ap.add_argument("--json")
    args = ap.parse_args()
    pieces = chunks_of(args.new)
    if chunks_of(args.base) != pieces:
        raise SystemExit("base and new do not have the same tensors at the same offsets")
    BASE[:], NEW[:] = load(args.base, pieces), load(args.new, pieces)
    ITEM[:] = [item for _, _, item in pieces]
    ENCODED[:] = [codec.encode(n, b, i) for n, b, i in zip(NEW, BASE, ITEM, strict=True)]
    for k, e in enumerate(ENCODED):  # the round trip is exact, so the timings are of correct work
        out = BASE[k].copy()
        if not np.array_equal(codec.decode(e.codec, e.payload, out, out.size, ITEM[k], out=out), NEW[k]):
            raise SystemExit(f"chunk {k} does not decode to the new bytes")
    gb = sum(b.size for b in BASE) / 1e9
    counts = [int(x) for x in args.workers.split(",")]
    rows: dict[str, Any] = {}
    for n in counts:
        for step, fn in (("encode", encode_part), ("decode", decode_part)):
            for how in ("threads", "processes"):
                rows[f"{step} {how} {n}"] = min(timed(fn, n, how) for _ in range(args.repeat))
    print(f"{len(pieces)} chunks, {gb:.3f} GB, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    print("| step | workers | threads s | processes s | threads speed-up | processes speed-up |")
    print("|---|---|---|---|---|---|")
    for step in ("encode", "decode"):
        t1, p1 = rows[f"{step} threads {counts[0]}"], rows[f"{step} processes {counts[0]}"]
        for n in counts:
            t, p = rows[f"{step} threads {n}"], rows[f"{step} processes {n}"]
            print(f"| {step} | {n} | {t:.3f} | {p:.3f} | {t1 / t:.2f}x | {p1 / p:.2f}x |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"chunks": len(pieces), "gb": gb, "cpus": os.cpu_count(), "seconds": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
