"""Two or more deltafs trees' update pulls of one template, alternating, each pull in a fresh process.

    python benchmarks/pull_ab.py TEMPLATE --tree . --tree /tmp/v1 --rounds 12 [--threads 1] [--json OUT]

TEMPLATE holds `store/` and a DEST (`dest` and `dest.deltafs/`) behind the store's HEAD, as
`benchmarks/sync_bench.py run` leaves its pull templates (`.../tmpl-pull`). Each tree's bytecode is compiled
first. Each pull copies the template to --scratch (not timed), imports deltafs from the tree on PYTHONPATH (checked), and times
`deltafs.read.pull.pull(store, dest, threads=T, recycle=True)` alone, imports excluded, as sync_bench's API rows
do; the result is compared byte for byte with the HEAD version's files as a fresh pull of the template
writes them. The trees alternate in order round by round. Prints the least and the median per tree. Never a
test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = r'''
import hashlib, json, os, shutil, sys, time
template, scratch, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
import deltafs
from deltafs.read.pull import pull
shutil.rmtree(scratch, ignore_errors=True)
shutil.copytree(template, scratch, symlinks=True)
t0 = time.perf_counter()
res = pull(os.path.join(scratch, "store"), os.path.join(scratch, "dest"), threads=threads, recycle=True)
seconds = time.perf_counter() - t0
files = {}
for root, _, names in os.walk(res.path):
    for n in names:
        p = os.path.join(root, n)
        files[os.path.relpath(p, res.path)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
shutil.rmtree(scratch, ignore_errors=True)
print(json.dumps({"seconds": seconds, "deltafs": deltafs.__file__, "version": res.version, "files": files}))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("template")
    ap.add_argument("--tree", action="append", required=True, help="a deltafs source tree (repeatable)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--scratch", default="/dev/shm/pull-ab")
    ap.add_argument("--json")
    ap.add_argument("--template-of", nargs=2, action="append", default=[], metavar=("TREE", "TEMPLATE"),
                    help="this tree pulls from its own template (a format change: each tree's store written by it); "
                         "every pull must still produce the same files")
    a = ap.parse_args()
    trees = [os.path.abspath(t) for t in a.tree]
    templates = {t: a.template for t in trees} | {os.path.abspath(t): tp for t, tp in a.template_of}
    for tree in trees:  # bytecode first, as an install writes it (these VMs set PYTHONDONTWRITEBYTECODE)
        subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(tree, "deltafs")], check=True)
    times: dict[str, list[float]] = {t: [] for t in trees}
    expect: dict[str, str] | None = None
    for r in range(a.rounds):
        for tree in trees if r % 2 == 0 else trees[::-1]:
            out = subprocess.run([sys.executable, "-c", WORKER, templates[tree], a.scratch, str(a.threads)],
                                 env=dict(os.environ, PYTHONPATH=tree), cwd="/", capture_output=True, text=True,
                                 check=True)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            if not got["deltafs"].startswith(tree + os.sep):
                raise SystemExit(f"imported {got['deltafs']}, not the tree {tree}")
            if expect is None:
                expect = got["files"]
            elif got["files"] != expect:
                raise SystemExit(f"{tree} pulled other bytes than the first pull")
            times[tree].append(got["seconds"])
    rows = {t: {"least_s": min(v), "median_s": statistics.median(v), "runs": v} for t, v in times.items()}
    for t, row in rows.items():
        print(f"{t}: least {row['least_s'] * 1e3:.1f} ms, median {row['median_s'] * 1e3:.1f} ms ({a.rounds} pulls)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"template": a.template, "templates": templates, "threads": a.threads, "rounds": a.rounds, "loadavg": os.getloadavg(),
                       "trees": rows}, f, indent=1)


if __name__ == "__main__":
    main()
