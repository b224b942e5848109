"""Two or more deltafs trees' delta pushes of one checkpoint, alternating, each push in a fresh process.

    python benchmarks/push_ab.py TEMPLATE NEW --tree . --tree /tmp/v1 --rounds 10 [--threads 1] [--json OUT]
    python benchmarks/push_ab.py TEMPLATE NEW --tree . --level 3 --level 5 ...   # levels, alternating the same way

TEMPLATE holds `store/` and `cache/` with the base pushed as the store's HEAD, as `benchmarks/sync_bench.py run`
leaves its push templates (`.../tmpl-push`); NEW is the checkpoint to push (`.../new`). pull_ab.py's counterpart,
timed as sync_bench's "cache beside the checkpoint" row: the store is copied to --scratch and the cache (`cp -a`,
untimed) to --cache-root, by default a folder beside NEW, so that the push hard-links NEW into the cache as it
does when both are on one filesystem. Each push imports deltafs from its tree on PYTHONPATH (checked) and times
`deltafs.push(store, NEW, cache_dir=..., threads=T)` alone, imports excluded, with the CPU seconds of its process
over the same span (every thread's). Every push must store the same chunk objects (their names, which are their
content's digests, are compared across trees; with --other-bytes, each tree's pushes only with each other). The trees alternate in order round by round. Prints the least and
the median per tree. With --level (repeatable) every tree pushes at each level given, as `tree@level` rows, each
(tree, level) held to its own objects. Never a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = r'''
import json, os, resource, shutil, subprocess, sys, time
template, new, scratch, cache, threads = sys.argv[1:5] + [int(sys.argv[5])]
level = {} if sys.argv[6] == "-" else {"level": int(sys.argv[6])}
import deltafs
from deltafs import push
for d in (scratch, cache):
    shutil.rmtree(d, ignore_errors=True)
os.makedirs(scratch)
subprocess.run(["cp", "-a", os.path.join(template, "store"), os.path.join(scratch, "store")], check=True)
subprocess.run(["cp", "-a", os.path.join(template, "cache"), cache], check=True)
os.sync()
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
res = push(os.path.join(scratch, "store"), new, cache_dir=cache, threads=threads, **level)
seconds, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
out = res.to_json()
import hashlib  # the content-addressed objects the push stored: the same set from every tree
names = sorted(os.path.relpath(os.path.join(d, f), scratch) for d, _, fs in os.walk(os.path.join(scratch, "store", "chunks"))
               for f in fs)
digest = hashlib.sha256("\n".join(names).encode()).hexdigest()
print(json.dumps({"seconds": seconds, "cpu_s": cpu, "deltafs": deltafs.__file__, "digest": digest,
                  "rederived": out["base_rederived"], "bytes_written": out["bytes_written"]}))
os._exit(0)  # skip waiting for the cache's old version to be freed: not part of the timed call
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("template")
    ap.add_argument("new")
    ap.add_argument("--tree", action="append", required=True, help="a deltafs source tree (repeatable)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--scratch", default="/dev/shm/push-ab")
    ap.add_argument("--cache-root", help="where the cache copy goes (default: beside NEW, on its filesystem)")
    ap.add_argument("--json")
    ap.add_argument("--level", type=int, action="append", help="the zstd level of the push (repeatable; default: push's)")
    ap.add_argument("--other-bytes", action="store_true",
                    help="a format change: the trees may store different objects (each must repeat its own)")
    a = ap.parse_args()
    trees = [os.path.abspath(t) for t in a.tree]
    new = os.path.abspath(a.new)
    cache = a.cache_root or os.path.join(os.path.dirname(new), "push-ab-cache")
    for tree in trees:  # bytecode first, as an install writes it (these VMs set PYTHONDONTWRITEBYTECODE)
        subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(tree, "deltafs")], check=True)
    levels: list[int | None] = list(a.level) if a.level else [None]
    combos = [(t, lv) for t in trees for lv in levels]
    key = {c: c[0] if c[1] is None else f"{c[0]}@{c[1]}" for c in combos}
    runs: dict[str, list[dict[str, float]]] = {key[c]: [] for c in combos}
    expect: dict[str, str] = {}
    try:
        for r in range(a.rounds):
            for tree, lv in combos if r % 2 == 0 else combos[::-1]:
                out = subprocess.run([sys.executable, "-c", WORKER, os.path.abspath(a.template), new, a.scratch, cache,
                                      str(a.threads), "-" if lv is None else str(lv)],
                                     env=dict(os.environ, PYTHONPATH=tree), cwd="/",
                                     capture_output=True, text=True, check=True)
                got = json.loads(out.stdout.strip().splitlines()[-1])
                if not got["deltafs"].startswith(tree + os.sep):
                    raise SystemExit(f"imported {got['deltafs']}, not the tree {tree}")
                if got["rederived"]:
                    raise SystemExit(f"{tree}: the push rebuilt its base from the store (the template's cache is stale)")
                # With --other-bytes (a format change) each tree is held to its own first push instead; levels
                # always differ in bytes.
                first = expect.setdefault(f"{tree if a.other_bytes else ''}@{lv}", got["digest"])
                if got["digest"] != first:
                    raise SystemExit(f"{key[tree, lv]} stored other chunk objects than the first push")
                runs[key[tree, lv]].append({"seconds": got["seconds"], "cpu_s": got["cpu_s"],
                                            "bytes_written": got["bytes_written"]})
    finally:
        subprocess.run(["rm", "-rf", a.scratch, cache], check=False)
    rows = {}
    for t, v in runs.items():
        wall, cpu = [x["seconds"] for x in v], [x["cpu_s"] for x in v]
        rows[t] = {"least_s": min(wall), "median_s": statistics.median(wall), "least_cpu_s": min(cpu),
                   "median_cpu_s": statistics.median(cpu), "runs": v}
        print(f"{t}: wall least {min(wall) * 1e3:.1f} ms, median {statistics.median(wall) * 1e3:.1f} ms; "
              f"CPU least {min(cpu) * 1e3:.1f} ms, median {statistics.median(cpu) * 1e3:.1f} ms ({a.rounds} pushes, "
              f"{v[0]['bytes_written']:,} bytes)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"template": a.template, "new": new, "threads": a.threads, "rounds": a.rounds, "levels": levels,
                       "loadavg": os.getloadavg(), "trees": rows}, f, indent=1)


if __name__ == "__main__":
    main()
