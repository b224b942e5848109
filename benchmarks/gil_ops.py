"""Which numpy calls of the sparse decode hold the GIL, and does the scatter form matter for the decode's scaling?

    python benchmarks/gil_ops.py                                   # part 1 only
    python benchmarks/gil_ops.py --base BASE.safetensors --new NEW.safetensors --threads 1,2 --rounds 7

Part 1: each call alone, on the sizes of one 4 MiB bf16 chunk with ~27,000 changes, in 1 thread and then in 2
threads at once (each its own output array): a call that releases the GIL gets up to 2x the throughput from two
threads on two cores; one that holds it stays at 1x or below (the threads hand the GIL back and forth).

Part 2 (with --base/--new): decode every 4 MiB chunk of the pair (encoded once, beforehand) onto a copy of its
base, split over N threads, with the codec's scatter as np.add.at (its default on numpy >= 1.25: one fast loop,
but it holds the GIL) and as `out[where] += diff` (a gather, an add and a scatter, which release it), alternating
in one process; least and median of --rounds. Never a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])  # gil_check, beside this script

N = 2 << 20  # elements of a 4 MiB bf16 chunk
CHANGES = 27_000


def _ops() -> dict[str, Callable[[np.ndarray], Any]]:
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 256, N // 4, dtype=np.uint8)
    base = rng.integers(0, 65535, N, dtype=np.uint16)
    idx = np.sort(rng.choice(N, CHANGES, replace=False))
    ones = np.ones(CHANGES, np.uint16)
    mask = rng.random(N) < CHANGES / N
    ints = rng.integers(0, 100, CHANGES * 8)
    return {
        "np.unpackbits": lambda o: np.unpackbits(bits),
        "bool .nonzero()": lambda o: mask.nonzero(),
        "np.add.at": lambda o: np.add.at(o, idx, ones),
        "o[idx] = v": lambda o: o.__setitem__(idx, ones),
        "o[idx]": lambda o: o[idx],
        "np.cumsum": lambda o: np.cumsum(ints),
        "np.copyto": lambda o: np.copyto(o, base),
    }


def _threads(fn: Callable[[int], None], n: int) -> float:
    ts = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def part1(calls: int) -> None:
    print("| call | 1 thread, us per call | 2 threads, throughput vs 1 |\n|---|---:|---:|")
    base = np.zeros(N, np.uint16)
    for name, op in _ops().items():
        outs = [base.copy(), base.copy()]

        def run(i: int, op: Callable[[np.ndarray], Any] = op) -> None:
            for _ in range(calls):
                op(outs[i])

        one = _threads(run, 1)
        two = _threads(run, 2)
        print(f"| `{name}` | {one / calls * 1e6:.0f} | {2 * one / two:.2f}x |")


def part2(base_path: str, new_path: str, thread_counts: list[int], rounds: int) -> None:
    from gil_check import chunks_of, load

    from deltafs import codec
    from deltafs.codec import codecs

    pieces = chunks_of(new_path)
    base, new = load(base_path, pieces), load(new_path, pieces)
    encs = [codec.encode(n, b, it) for n, b, (_, _, it) in zip(new, base, pieces, strict=True)]
    outs = [b.copy() for b in base]

    def decode(ids: list[int]) -> None:
        for i in ids:
            np.copyto(outs[i], base[i])
            codec.decode(encs[i].codec, encs[i].payload, outs[i], outs[i].size, pieces[i][2], out=outs[i])

    times: dict[tuple[str, int], list[float]] = {}
    default = codecs._ADD_AT
    try:
        for _ in range(rounds):
            for form, fast in (("np.add.at", True), ("out[where] += diff", False)):
                codecs._ADD_AT = fast
                for n in thread_counts:
                    parts = [list(range(len(pieces)))[k::n] for k in range(n)]
                    times.setdefault((form, n), []).append(_threads(lambda k: decode(parts[k]), n))
    finally:
        codecs._ADD_AT = default
    for i, (n, b) in enumerate(zip(new, outs, strict=True)):
        if not np.array_equal(n, b):
            raise SystemExit(f"chunk {i} decoded wrong")
    print(f"\n{len(pieces)} chunks, decode onto a copy of the base, {rounds} rounds (least / median s)\n")
    print("| scatter | " + " | ".join(f"{n} thread(s)" for n in thread_counts) + " |")
    print("|---|" + "---|" * len(thread_counts))
    for form in ("np.add.at", "out[where] += diff"):
        cells = [f"{min(times[(form, n)]):.3f} / {statistics.median(times[(form, n)]):.3f}" for n in thread_counts]
        print(f"| {form} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--base")
    ap.add_argument("--new")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    part1(a.calls)
    if a.base and a.new:
        part2(a.base, a.new, [int(x) for x in a.threads.split(",")], a.rounds)


if __name__ == "__main__":
    main()
