"""push_tensors of non-contiguous tensors (transposed views): peak memory and time, read a range at a time against
each tensor made contiguous up front (what push_tensors did before deltafs.publish.hf.StridedBytes).

    python benchmarks/strided_push.py --work /tmp/strided --mib 256 --rounds 2 --json docs/strided_push.json

Each mode and round runs in a fresh process: it makes --mib MiB of float32 matrices, takes their transposes (every
one non-contiguous), pushes them (a full version), moves every element a little in place and pushes again (a delta),
and reports both pushes' wall time and the growth of its peak RSS over what it held with the tensors made. Mode
"upfront" replaces tensor_bytes with the old rule (.contiguous() of each tensor, then its bytes). Never a test:
timings depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

CHILD = r"""
import json, resource, shutil, sys, time
import torch
mode, work, mib, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
from deltafs.publish import hf
if mode == "upfront":
    plain = hf.tensor_bytes
    hf.tensor_bytes = lambda t, baseline=None, name="": plain(t.contiguous(), baseline, name)
from deltafs.publish import push_tensors
n = mib * (1 << 20) // (4 * 1024 * 2048)
gen = torch.Generator().manual_seed(0)
ts = {f"w{i}": torch.randn(1024, 2048, generator=gen).t() for i in range(n)}
shutil.rmtree(work, ignore_errors=True)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
push_tensors(work + "/store", ts, cache_dir=work + "/cache", threads=threads)
t1 = time.perf_counter()
for t in ts.values():
    t.add_(1e-3)
t2 = time.perf_counter()
push_tensors(work + "/store", ts, cache_dir=work + "/cache", threads=threads)
t3 = time.perf_counter()
grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
print(json.dumps({"mode": mode, "full_s": t1 - t0, "delta_s": t3 - t2, "rss_growth_mib": grew}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for r in range(args.rounds):
        for mode in ("ranges", "upfront"):  # interleaved
            out = subprocess.run([sys.executable, "-c", CHILD, mode, os.path.join(args.work, mode), str(args.mib),
                                  str(args.threads)], capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["round"] = r
            rows.append(row)
            print(f"{mode:8} round {r}: full {row['full_s']:.2f} s, delta {row['delta_s']:.2f} s, "
                  f"peak RSS +{row['rss_growth_mib']:.0f} MiB", flush=True)
    shutil.rmtree(args.work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"mib": args.mib, "threads": args.threads, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
