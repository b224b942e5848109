"""CLI start-up: wall time of commands that do no real work, and which heavy libraries each imports.

    python benchmarks/cli_startup.py [--runs 5]

Pushes two versions of a tiny checkpoint to a store in a temporary directory, then runs
`deltafs --help`, `deltafs log STORE` and `deltafs version` through the installed console command
--runs times each and prints the least wall time and the least CPU time (the runs least disturbed
by other processes), and,
from `python -X importtime -m deltafs.cli.main ...`, which of numpy, zstandard, xxhash, torch and
fsspec the command imported. Results: docs/cli_startup.md.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np
from safetensors.numpy import save_file

HEAVY = ("numpy", "zstandard", "xxhash", "torch", "fsspec")
CONSOLE = os.path.join(os.path.dirname(sys.executable), "deltafs")


def make_store(work: str) -> str:
    store = os.path.join(work, "store")
    rng = np.random.default_rng(0)
    weights = {"w": rng.standard_normal((256, 256)).astype(np.float32)}
    for step in (1, 2):
        ckpt = os.path.join(work, f"ckpt-{step}")
        os.makedirs(ckpt)
        weights["w"][step] += 1.0
        save_file(weights, os.path.join(ckpt, "model.safetensors"))
        subprocess.run([CONSOLE, "push", ckpt, store, "--quiet"], check=True)
    return store


def least_seconds(args: list[str], runs: int) -> tuple[float, float]:
    """The least wall time and the least CPU time (user + system) of the command over runs.

    CPU time is the steadier number on a machine shared with other jobs: waiting for a core is not counted.
    """
    wall = cpu = float("inf")
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run([CONSOLE, *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = min(wall, time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = min(cpu, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return wall, cpu


def heavy_imports(args: list[str]) -> list[str]:
    """Which of HEAVY the command imports, from -X importtime's lines (module name last)."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "deltafs.cli.main", *args],
                          capture_output=True, text=True, check=True)
    names = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    return [h for h in HEAVY if h in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    runs = parser.parse_args().runs
    with tempfile.TemporaryDirectory() as work:
        store = make_store(work)
        print(f"| command | wall, least of {runs} | CPU, least of {runs} | heavy libraries imported |")
        print("|---|---|---|---|")
        for args in (["--help"], ["log", store], ["version"]):
            shown = " ".join("STORE" if a == store else a for a in args)
            imported = ", ".join(heavy_imports(args)) or "none"
            wall, cpu = least_seconds(args, runs)
            print(f"| `deltafs {shown}` | {wall:.3f} s | {cpu:.3f} s | {imported} |")


if __name__ == "__main__":
    main()
