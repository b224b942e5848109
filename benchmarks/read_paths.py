"""How a push reads a chunk and its base: pread into recycled page-aligned buffers, or views of the page cache.

    python benchmarks/read_paths.py NEW.safetensors BASE.safetensors [--chunk-mib 4] [--rounds 5] [--json OUT]

Times, over every whole chunk of the two files (both in the page cache: each is read once first), what the
encoder does around its codec: read the new chunk and its base, compare them (the compiled compare,
`deltafs.codec.compare.changes`, as the codec calls it), and, in the "+ digests" ways, take both chunk digests (xxh3-128)
after the compare as the encoder does. Two ways to read: `pread` into two recycled aligned buffers (deltafs before
round 16) and a mapping per chunk populated in one call (`deltafs.buffers.mapped_range`, round 16); and the pread
alone. Prints the least and the median per way; GB/s counts both files. Never a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import numpy as np

from deltafs.buffers import aligned_empty, mapped_range, pread_aligned
from deltafs.codec import native
from deltafs.codec.compare import changes
from deltafs.format.digests import chunk_digest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("new")
    ap.add_argument("base")
    ap.add_argument("--chunk-mib", type=float, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    if native.loops() is None:
        raise SystemExit("the compiled codec loops are not built here")
    cb = int(args.chunk_mib * (1 << 20))
    size = min(os.path.getsize(args.new), os.path.getsize(args.base))
    offsets = list(range(0, size - cb + 1, cb))
    fn, fb = os.open(args.new, os.O_RDONLY), os.open(args.base, os.O_RDONLY)
    bufs = aligned_empty(cb), aligned_empty(cb)

    def compare(n: object, b: object) -> int:
        return int(changes(np.frombuffer(n, np.uint8), np.frombuffer(b, np.uint8), 2)[0].size)

    def pair(mapped: bool, o: int) -> tuple[Any, Any]:
        if not mapped:
            return pread_aligned(fn, cb, o, bufs[0]), pread_aligned(fb, cb, o, bufs[1])
        n, b = mapped_range(fn, cb, o), mapped_range(fb, cb, o)
        if n is None or b is None:
            raise SystemExit("these files cannot be mapped here")
        return n, b

    def run(mapped: bool, with_digests: bool) -> int:
        total = 0
        for o in offsets:
            n, b = pair(mapped, o)
            total += compare(n, b)
            if with_digests:
                chunk_digest(n), chunk_digest(b)
        return total

    def pread_only() -> int:
        for o in offsets:
            pair(False, o)
        return 0

    ways = {"pread + compare": lambda: run(False, False), "mapped + compare": lambda: run(True, False),
            "pread alone": pread_only, "pread + compare + digests": lambda: run(False, True),
            "mapped + compare + digests": lambda: run(True, True)}
    pread_only()  # both files into the page cache
    times: dict[str, list[float]] = {k: [] for k in ways}
    results: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, fn_ in ways.items():
            t = time.perf_counter()
            results[name] = fn_()
            times[name].append(time.perf_counter() - t)
    if len({results[k] for k in ways if k != "pread alone"}) != 1:
        raise SystemExit("the two ways found different changes")
    moved = 2 * cb * len(offsets)
    out = {"new": args.new, "base": args.base, "chunk_bytes": cb, "chunks": len(offsets), "simd": native.simd_level,
           "changed_elements": results["pread + compare"], "ways": {}}
    for name, ts in times.items():
        least, median = min(ts), statistics.median(ts)
        out["ways"][name] = {"least_s": least, "median_s": median, "gb_s_least": moved / least / 1e9}
        print(f"{name:28s} least {least * 1e3:8.1f} ms  median {median * 1e3:8.1f} ms  {moved / least / 1e9:5.2f} GB/s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
