"""Two kernel copy paths that set the floor of a pull and a push on the benchmark VM, measured in isolation.

1. pread of a chunk into a user buffer, by the buffer's offset from a page boundary (malloc, bytearray and numpy
   put large buffers 16 bytes past one; deltafs.buffers aligns them to the page).
2. pwrite of a chunk into a file: into pages the file already has (a recycled version's, deltafs.read.dest) or into
   a new file whose pages are allocated by the write (a fresh staging directory).
3. A pull's copy of a version into a recycled file, chunk by chunk: read the base chunk, change 1.3% of its
   2-byte elements, hash it (xxh3-128), write it; then fsync. Done as deltafs does it (pread into an aligned
   buffer, pwrite), with the output file memory-mapped (pread straight into the mapping, no pwrite), and with
   both files mapped (a memory copy between the mappings).

    python benchmarks/io_paths.py --dir /dev/shm/io-paths --json docs/io_paths.json

Each figure is the best of --repeat passes over --mib MiB in --chunk-mib chunks (GB/s of wall time, one thread).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np


def best_rate(nbytes: int, repeat: int, fn: Callable[[], None], before: Callable[[], None] | None = None) -> float:
    low = float("inf")
    for _ in range(repeat):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        low = min(low, time.perf_counter() - t)
    return nbytes / low / 1e9


def at_offset(size: int, offset: int) -> np.ndarray:
    raw = np.empty(size + 8192, np.uint8)
    start = -raw.ctypes.data % 4096 + offset
    out = raw[start:start + size]
    out[:] = 1  # pages present: only the copy is timed
    return out


def pull_copy_rates(src_fd: int, out: Path, chunk: int, total: int, repeat: int) -> dict[str, float]:
    """GB/s of the three ways (module docstring, 3) to copy src into the existing file out with a sparse change."""
    import mmap

    import xxhash

    rng = np.random.default_rng(1)
    pos = np.sort(rng.choice(chunk // 2, size=int(chunk // 2 * 0.013), replace=False))
    vals = rng.integers(0, 1 << 16, size=pos.size, dtype=np.uint16)
    buf = at_offset(chunk, 0)

    def change_and_hash(view: np.ndarray) -> None:
        view.view(np.uint16)[pos] = vals
        xxhash.xxh3_128_digest(view)

    def with_pwrite() -> None:
        wfd = os.open(out, os.O_WRONLY)
        try:
            for p in range(0, total, chunk):
                os.preadv(src_fd, [buf.data], p)
                change_and_hash(buf)
                os.pwrite(wfd, buf.data, p)
            os.fsync(wfd)
        finally:
            os.close(wfd)

    def mapped(src_too: bool) -> None:
        wfd = os.open(out, os.O_RDWR)
        try:
            os.posix_fallocate(wfd, 0, total)  # a hole written through a mapping would SIGBUS on a full disk
            with mmap.mmap(wfd, total, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE) as m, \
                    mmap.mmap(src_fd, total, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE) as sm:
                dst, src = np.frombuffer(m, np.uint8), np.frombuffer(sm, np.uint8)
                for p in range(0, total, chunk):
                    view = dst[p:p + chunk]
                    if src_too:
                        np.copyto(view, src[p:p + chunk])
                    else:
                        os.preadv(src_fd, [view.data], p)
                    change_and_hash(view)
                del dst, src, view
            os.fsync(wfd)
        finally:
            os.close(wfd)

    return {"pread, pwrite (deltafs)": round(best_rate(total, repeat, with_pwrite), 2),
            "pread into a mapped output": round(best_rate(total, repeat, lambda: mapped(False)), 2),
            "both files mapped, memory copy": round(best_rate(total, repeat, lambda: mapped(True)), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="scratch directory (tmpfs for the numbers in docs/)")
    ap.add_argument("--mib", type=int, default=400)
    ap.add_argument("--chunk-mib", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    chunk, total = args.chunk_mib << 20, args.mib << 20
    src = work / "src.bin"
    with open(src, "wb") as fh:
        block = np.random.default_rng(0).integers(0, 256, chunk, dtype=np.uint8).tobytes()
        for _ in range(total // chunk):
            fh.write(block)
    fd = os.open(src, os.O_RDONLY)
    res: dict[str, Any] = {"machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                                       "kernel": platform.release()},
                           "args": vars(args), "pread_GBps_by_buffer_offset": {}, "pwrite_GBps": {}}
    for off in (0, 16, 32, 48, 64, 2048):
        buf = at_offset(chunk, off)
        view = buf.data

        def read_all() -> None:
            for pos in range(0, total, chunk):
                os.preadv(fd, [view], pos)

        res["pread_GBps_by_buffer_offset"][str(off)] = round(best_rate(total, args.repeat, read_all), 2)
    data = at_offset(chunk, 0).data
    out = work / "out.bin"

    def write_all(path: Path, flags: int) -> None:
        wfd = os.open(path, os.O_WRONLY | flags, 0o644)
        try:
            for pos in range(0, total, chunk):
                os.pwrite(wfd, data, pos)
        finally:
            os.close(wfd)

    def remove() -> None:
        if out.exists():
            out.unlink()

    res["pwrite_GBps"]["new file (pages allocated by the write)"] = round(
        best_rate(total, args.repeat, lambda: write_all(out, os.O_CREAT | os.O_EXCL), before=remove), 2)
    write_all(out, os.O_CREAT)
    res["pwrite_GBps"]["existing file, same size (pages reused)"] = round(
        best_rate(total, args.repeat, lambda: write_all(out, 0)), 2)
    res["pull_copy_GBps"] = pull_copy_rates(fd, out, chunk, total, args.repeat)
    os.close(fd)
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
