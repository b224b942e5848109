"""Buffered writes of one file from several threads against writes of one file per thread: does the page cache
take a file's writes in parallel? Never a test.

    python benchmarks/write_scaling.py --dir /dev/shm --mib 512 --threads 1,2 --rounds 3 [--json OUT]

Each thread `pwrite`s 4 MiB chunks (a page-aligned buffer, as the pull writes its runs) at disjoint offsets,
interleaved: `same file` has every thread write its share of one file, `own files` gives each thread its own file
of the same total size, and `same file, mapped` has every thread copy its chunks into a shared writable mapping of
one file (numpy copies, which release the GIL) instead of calling `pwrite`; `mapped, populated` first asks the
kernel to map each chunk's pages writable in one call (madvise MADV_POPULATE_WRITE, Linux 5.14), so the copy takes
no page fault. Both start from files whose pages exist already (written once before the clock starts, as
a pull that recycles an old version's files finds them) and again from empty files (`--fresh`: the page cache
allocates every page during the timed writes). Prints GB/s, the best of --rounds.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import threading
import time

import numpy as np

from deltafs.buffers import aligned_empty
from deltafs.read.rebuild import pwrite_all

CHUNK = 4 << 20


def _write(fd: int, buf: memoryview, chunks: range) -> None:
    for i in chunks:
        pwrite_all(fd, buf, i * CHUNK)


MADV_POPULATE_WRITE = 23  # linux/mman.h; not in Python 3.11's mmap module


def _copy(region: mmap.mmap | None, mapped: np.ndarray, buf: np.ndarray, chunks: range) -> None:
    for i in chunks:
        if region is not None:
            region.madvise(MADV_POPULATE_WRITE, i * CHUNK, CHUNK)
        np.copyto(mapped[i * CHUNK:(i + 1) * CHUNK], buf)


def measure(directory: str, mib: int, threads: int, same: bool, fresh: bool, mapped: bool = False,
            populate: bool = False) -> float:
    total = mib << 20
    nchunks = total // CHUNK
    files = 1 if same else threads
    paths = [os.path.join(directory, f"write-scaling-{os.getpid()}-{k}") for k in range(files)]
    bufs = [aligned_empty(CHUNK) for _ in range(threads)]
    for b in bufs:
        b[:] = 0x5A
    fds = [os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600) for p in paths]
    try:
        per_file = nchunks // files
        for fd in fds:
            os.ftruncate(fd, per_file * CHUNK)
            if not fresh:
                _write(fd, bufs[0].data, range(per_file))
        if same:
            jobs = [(fds[0], range(k, nchunks, threads)) for k in range(threads)]
        else:
            jobs = [(fds[k], range(per_file)) for k in range(threads)]
        if mapped:
            region = mmap.mmap(fds[0], nchunks * CHUNK, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            view = np.frombuffer(region, np.uint8)
            workers = [threading.Thread(target=_copy, args=(region if populate else None, view, bufs[k], chunks))
                       for k, (_fd, chunks) in enumerate(jobs)]
        else:
            workers = [threading.Thread(target=_write, args=(fd, bufs[k].data, chunks))
                       for k, (fd, chunks) in enumerate(jobs)]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        seconds = time.perf_counter() - start
        if mapped:
            del view, workers
            region.close()
        return total / seconds / 1e9
    finally:
        for fd in fds:
            os.close(fd)
        for p in paths:
            os.unlink(p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--mib", type=int, default=512, help="bytes written per measurement, in MiB (all threads together)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    for fresh in (False, True):
        for n in [int(x) for x in a.threads.split(",")]:
            ways = [(True, False, False), (True, True, False), (True, True, True)] + ([(False, False, False)] if n > 1 else [])
            for same, mapped, populate in ways:
                best = max(measure(a.dir, a.mib, n, same, fresh, mapped, populate) for _ in range(a.rounds))
                how = ("same file, mapped, populated" if populate else "same file, mapped" if mapped
                       else "same file" if same else "own files")
                row = {"threads": n, "how": how, "pages": "new" if fresh else "existing", "gb_per_s": round(best, 2)}
                rows.append(row)
                print(f"{row['pages']:8s} pages, {n} thread(s), {how}: {best:.2f} GB/s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"dir": a.dir, "mib": a.mib, "rounds": a.rounds, "cpus": os.cpu_count(),
                       "loadavg": os.getloadavg(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
