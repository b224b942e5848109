"""A keyframe with and without its bridge: what the push costs, and what a host that holds the parent reads.

    python benchmarks/keyframe_bridge.py BASE NEW --work /dev/shm/kfb --rounds 3 --threads 1 \
        [--json docs/keyframe_bridge.json]

BASE and NEW are checkpoint directories (a sync_bench data set's `base` and `new`). A template store gets an older
version (sync_bench's make_older of BASE) and BASE as versions 1 and 2, with the push cache that made them, and a
template DEST pulls versions 1 then 2 (so an update pull recycles, as in sync_bench). Each round, for each way of
publishing NEW as version 3, a fresh copy of the store and cache takes the push, then a fresh copy of DEST the pull:

- `keyframe + bridge`: `push(..., full=True)`, the default: the full version and its bridge (a delta against 2);
- `keyframe`: `push(..., full=True, bridge=False)`: the full version alone (before bridges, every keyframe);
- `delta`: `push(...)`: an ordinary delta, for scale.

Every push and pull runs alone in a fresh Python process (the call timed inside it, imports not counted), the
three ways in a rotating order. Reported per way: the push's seconds, bytes written (chunks and manifest) and
bridge bytes; the pull's seconds, bytes read and whether it started from the full version; every pulled DEST is
compared with NEW file by file. `cp -r` of NEW gives the scale. Never a test: timings on a shared machine vary.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from sync_bench import fresh, make_older  # benchmarks/ is on sys.path when a script there runs

WAYS = {"keyframe + bridge": {"full": True}, "keyframe": {"full": True, "bridge": False}, "delta": {}}

_PUSH = """
import json, sys, time
from deltafs import push
store, src, cache, threads, opts = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), json.loads(sys.argv[5])
t = time.perf_counter()
r = push(store, src, cache_dir=cache, threads=threads, **opts)
s = time.perf_counter() - t
print(json.dumps({"seconds": s, "kind": r.kind, "bytes_written": r.bytes_written, "bridge_bytes": r.bridge_bytes}))
"""

_PULL = """
import json, sys, time
from deltafs import pull
store, dest, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
t = time.perf_counter()
r = pull(store, dest, threads=threads)
s = time.perf_counter() - t
print(json.dumps({"seconds": s, "version": r.version, "bytes_read": r.bytes_read, "from_full": r.from_full,
                  "fallback": r.fallback}))
"""


def _run(code: str, *args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _copy(src: Path, dst: Path) -> None:
    fresh(dst)
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)


def _same_tree(a: Path, b: Path) -> bool:
    names = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    return names == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file()) and \
        all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--work", type=Path, required=True, help="scratch directory (tmpfs: /dev/shm/...)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    from deltafs import pull, push

    w = fresh(a.work)
    w.mkdir(parents=True)
    # The checkpoints on the scratch filesystem, so the push cache links them as a trainer's cache would.
    base, new, older = w / "base", w / "new", w / "older"
    shutil.copytree(a.base, base)
    shutil.copytree(a.new, new)
    make_older(base, older)
    tmpl_store, tmpl_cache, tmpl_dest = w / "tmpl" / "store", w / "tmpl" / "cache", w / "tmpl" / "dest"
    for src in (older, base):
        push(str(tmpl_store), str(src), cache_dir=str(tmpl_cache))
    for v in (1, 2):
        pull(str(tmpl_store), str(tmpl_dest), version=v)
    fresh(older)
    cp = []
    for _ in range(a.rounds):
        fresh(w / "cp")
        t = time.perf_counter()
        subprocess.run(["cp", "-r", str(new), str(w / "cp")], check=True)
        cp.append(time.perf_counter() - t)
    fresh(w / "cp")
    rows: dict[str, dict[str, list[Any]]] = {way: {"push": [], "pull": []} for way in WAYS}
    order = list(WAYS)
    for r in range(a.rounds):
        for way in order[r % len(order):] + order[:r % len(order)]:
            run = w / "run"
            fresh(run)
            run.mkdir()
            _copy(tmpl_store, run / "store")
            _copy(tmpl_cache, run / "cache")
            p = _run(_PUSH, str(run / "store"), str(new), str(run / "cache"), str(a.threads), json.dumps(WAYS[way]))
            fresh(run / "cache")
            _copy(tmpl_dest, run / "dest")
            _copy(Path(str(tmpl_dest) + ".deltafs"), Path(str(run / "dest") + ".deltafs"))
            q = _run(_PULL, str(run / "store"), str(run / "dest"), str(a.threads))
            if r == 0 and not _same_tree(run / "dest", new):
                raise SystemExit(f"{way}: the pulled DEST differs from NEW")
            assert q["version"] == 3, q
            rows[way]["push"].append(p)
            rows[way]["pull"].append(q)
            fresh(run)
    size = _tree_bytes(new)
    print(f"NEW: {size / 1e9:.3f} GB; `cp -r` {min(cp):.3f} s (least of {a.rounds}); {a.threads} thread(s)")
    print("| way | push s (least / median) | written | bridge | pull s (least / median) | read | pull from |")
    print("|---|---|---:|---:|---|---:|---|")
    summary: dict[str, Any] = {}
    for way, d in rows.items():
        ps, qs = [x["seconds"] for x in d["push"]], [x["seconds"] for x in d["pull"]]
        last_p, last_q = d["push"][-1], d["pull"][-1]
        summary[way] = {"push_least": min(ps), "push_median": statistics.median(ps), "pull_least": min(qs),
                        "pull_median": statistics.median(qs), "bytes_written": last_p["bytes_written"],
                        "bridge_bytes": last_p["bridge_bytes"], "bytes_read": last_q["bytes_read"],
                        "from_full": last_q["from_full"]}
        print(f"| {way} | {min(ps):.3f} / {statistics.median(ps):.3f} | {last_p['bytes_written']:,} | "
              f"{last_p['bridge_bytes']:,} | {min(qs):.3f} / {statistics.median(qs):.3f} | {last_q['bytes_read']:,} | "
              f"{'the full version' if last_q['from_full'] else 'version 2'} |")
    if a.json:
        out = {"args": {k: str(v) for k, v in vars(a).items()}, "checkpoint_bytes": size, "cp_r": cp,
               "threads": a.threads, "cpus": os.cpu_count(), "rows": rows, "summary": summary,
               "load": os.getloadavg()}
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    fresh(w)


if __name__ == "__main__":
    main()
