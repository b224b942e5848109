"""What the watcher's full pre-switch check costs against the page-cache warm it replaces.

    python benchmarks/prestage_check.py --work /tmp/prestage --mib 1024 --rounds 3 --json docs/prestage_check.json

Before switching an engine that loads from disk (SGLang, vLLM), the watcher reads the staged version's files once so
that the engine's own load reads from memory. It now hashes them on that read (LocalCheckpoint.check_files with
full=True, the manifest's XXH3 tree digests) instead of only reading them (warm_page_cache). This pushes and pulls one
bf16 file of --mib MiB of random bits, then times both, alternating, with the page cache warm (what the watcher
meets right after its pull) and, where the process may drop the cache (root: /proc/sys/vm/drop_caches), cold.
Never a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import time

import numpy as np


def _drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()

    from deltafs.engines.switch import warm_page_cache
    from deltafs.publish import push
    from deltafs.read.dest import LocalCheckpoint
    from deltafs.read.pull import pull
    from deltafs.testing.checkpoints import write_safetensors

    shutil.rmtree(args.work, ignore_errors=True)
    src = os.path.join(args.work, "src")
    os.makedirs(src)
    n = args.mib << 19  # bf16 elements
    data = np.random.default_rng(0).integers(0, 1 << 16, n, dtype=np.uint16).tobytes()
    write_safetensors(os.path.join(src, "model.safetensors"), {"w": ("BF16", (n,), data)})
    del data
    store, dest = os.path.join(args.work, "store"), os.path.join(args.work, "dest")
    push(store, src)
    pull(store, dest)
    local = LocalCheckpoint(dest)
    state = local.state()
    assert state is not None

    def check() -> None:
        assert local.check_files(state, full=True) is None

    def warm() -> None:
        warm_page_cache(state.path)

    rows: dict[str, list[float]] = {"hash (warm cache)": [], "read only (warm cache)": []}
    cold = _drop_caches()
    if cold:
        rows.update({"hash (cold cache)": [], "read only (cold cache)": []})
    for _ in range(args.rounds):
        for name, fn in (("hash", check), ("read only", warm)):
            fn()  # the cache warm
            t0 = time.perf_counter()
            fn()
            rows[f"{name} (warm cache)"].append(time.perf_counter() - t0)
            if cold:
                _drop_caches()
                t0 = time.perf_counter()
                fn()
                rows[f"{name} (cold cache)"].append(time.perf_counter() - t0)
    out = {"mib": args.mib, "rounds": args.rounds, "cpus": os.cpu_count(), "python": platform.python_version(),
           "load_average": os.getloadavg(), "seconds": rows,
           "median_seconds": {k: statistics.median(v) for k, v in rows.items()}}
    print(json.dumps(out["median_seconds"], indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
            fh.write("\n")
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
