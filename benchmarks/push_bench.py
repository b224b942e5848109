"""Push benchmark: a full and a delta push of a generator checkpoint, each in its own process, beside `cp -r`.

    python benchmarks/push_bench.py --work /tmp/pushbench --layers 4 [--python OTHER_VENV/bin/python ...]

The checkpoint is deltafs.testing.generator's LLAMA_1B cut to --layers decoder layers (4: 0.5B
parameters, ~1 GB of bf16) at two consecutive trainer steps (~1.3% of elements changed). For each
interpreter given (e.g. the venv of another checkout, to compare two versions of deltafs in one run)
it pushes step 1 (full) then step 2 (delta) into a fresh store and cache, and reports wall seconds,
CPU seconds (user + system: what a busy host pays) and peak RSS of each push, then `cp -r` of the
same checkpoint. Output: a markdown table on stdout, JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PUSH = """
import json, sys, time
from deltafs.publish import push
t = time.monotonic()
r = push(sys.argv[1], sys.argv[2], cache_dir=sys.argv[3])
print(json.dumps({"kind": r.kind, "seconds": time.monotonic() - t, "bytes_written": r.bytes_written}))
"""

GEN = """
import sys
from deltafs.testing.generator import LLAMA_1B, TrainerSim, write_checkpoint
cfg = LLAMA_1B.with_layers(int(sys.argv[2]))
sim = TrainerSim(cfg, seed=0, lr=9e-7)
for step in (1, 2):
    write_checkpoint(f"{sys.argv[1]}/v{step}", sim.step(), cfg, step=step, shard_bytes=600 << 20)
"""


def timed(cmd: list[str]) -> dict[str, Any]:
    """Run cmd; wall seconds, CPU seconds of the child and its peak RSS, and its JSON stdout if any."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    stdout = proc.stdout.read()
    _pid, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage (RUSAGE_CHILDREN would sum them)
    wall = time.monotonic() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{cmd[0]} failed")
    out: dict[str, Any] = {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "max_rss_mib": usage.ru_maxrss / 1024}
    if stdout.strip().startswith("{"):
        out.update(json.loads(stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--python", action="append", help="interpreter(s) whose deltafs to time (default: this one)")
    ap.add_argument("--out")
    args = ap.parse_args()
    work = Path(args.work)
    src = work / "src"
    if not (src / "v2").exists():
        subprocess.run([sys.executable, "-c", GEN, str(src), str(args.layers)], check=True)
    rows = []
    for py in args.python or [sys.executable]:
        run = work / "run"
        shutil.rmtree(run, ignore_errors=True)
        for step in ("v1", "v2"):
            os.sync()
            res = timed([py, "-c", PUSH, str(run / "store"), str(src / step), str(run / "cache")])
            rows.append({"python": py, "push": step, **res})
    os.sync()
    shutil.rmtree(work / "copy", ignore_errors=True)
    rows.append({"python": "cp -r", "push": "v2", **timed(["cp", "-r", str(src / "v2"), str(work / "copy")])})
    shutil.rmtree(work / "copy", ignore_errors=True)
    print("| deltafs of | push | kind | wall s | CPU s | peak RSS MiB | bytes written |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['python']} | {r['push']} | {r.get('kind', '-')} | {r['wall']:.2f} | {r['cpu']:.2f} | "
              f"{r['max_rss_mib']:.0f} | {r.get('bytes_written', '-')} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "cpus": os.cpu_count(), "load": os.getloadavg()}, indent=1))


if __name__ == "__main__":
    main()
