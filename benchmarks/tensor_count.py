"""Does a model with many tensors push and pull slower than one with few, for the same bytes and changes?

    python benchmarks/tensor_count.py --base B/model.safetensors --new N/model.safetensors --work /dev/shm/tc \
        --piece-mib 1 --rounds 2

Re-slices every 2-byte tensor of a base/new safetensors pair into tensors of --piece-mib MiB (each its own
segment, so chunks of at most that size instead of 4 MiB), keeping the bytes and so the changes. Then, for the
original pair and the re-sliced one in turn: a store with the base pushed (untimed), DEST pulled from it
(untimed), then one timed delta push of the new version and one timed update pull (Python API, --threads).
Rounds alternate original and re-sliced; wall seconds of each call are printed.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import numpy as np


def reslice(src: Path, dst: Path, piece: int) -> int:
    """Write dst/model.safetensors holding src's 2-byte tensors cut into 1-D tensors of piece bytes; returns count."""
    from deltafs.testing.checkpoints import safetensors_layout, write_safetensors

    raw = np.memmap(src, dtype=np.uint8, mode="r")
    out = {}
    for name, (dtype, offset, nb) in safetensors_layout(str(src)).items():
        if dtype not in ("BF16", "F16"):
            continue
        for k, start in enumerate(range(0, nb, piece)):
            end = min(nb, start + piece)
            out[f"{name}.piece{k}"] = (dtype, ((end - start) // 2,), raw[offset + start:offset + end].tobytes())
    dst.mkdir(parents=True, exist_ok=True)
    write_safetensors(str(dst / "model.safetensors"), out)
    return len(out)


def one_round(base: Path, new: Path, work: Path, threads: int) -> tuple[float, float, int]:
    from deltafs import pull, push

    shutil.rmtree(work, ignore_errors=True)
    store, cache, dest = str(work / "store"), str(work / "cache"), str(work / "dest")
    push(store, str(base), cache_dir=cache, threads=threads)
    pull(store, dest, threads=threads)
    t = time.perf_counter()
    res = push(store, str(new), cache_dir=cache, threads=threads)
    t_push = time.perf_counter() - t
    t = time.perf_counter()
    pull(store, dest, threads=threads)
    t_pull = time.perf_counter() - t
    shutil.rmtree(work, ignore_errors=True)
    return t_push, t_pull, res.chunks_written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, type=Path)
    ap.add_argument("--new", required=True, type=Path)
    ap.add_argument("--work", required=True, type=Path, help="scratch (the re-sliced pair, stores, DEST)")
    ap.add_argument("--piece-mib", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    piece = int(args.piece_mib * (1 << 20)) // 2 * 2
    sliced = args.work / "resliced"
    count = reslice(args.base, sliced / "base", piece)
    reslice(args.new, sliced / "new", piece)
    pairs = {"original": (args.base.parent, args.new.parent),
             f"{count} tensors of {args.piece_mib:g} MiB": (sliced / "base", sliced / "new")}
    print("| checkpoint | round | chunks written | push s | pull s |")
    print("|---|---|---|---|---|")
    for r in range(args.rounds):
        for label, (base, new) in pairs.items():
            t_push, t_pull, chunks = one_round(base, new, args.work / "run", args.threads)
            print(f"| {label} | {r + 1} | {chunks} | {t_push:.3f} | {t_pull:.3f} |", flush=True)
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
