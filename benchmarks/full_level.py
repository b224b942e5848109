"""Full versions at zstd level 1 against 3 (and others): the push, the bytes, and a first pull into an empty DEST.

    python benchmarks/full_level.py CHECKPOINT_DIR --work /dev/shm/fl --levels 1 3 --rounds 4 --threads 1 \
        [--json docs/full_level.json]

Each round, for each level in a rotating order: `push(..., full_level=L)` of CHECKPOINT_DIR into a fresh store
(a full version: every chunk `raw`, byte planes in one zstd frame), then `pull` of it into an empty DEST, each
alone in a fresh Python process with the call timed inside it. Reported per level: push and pull seconds (least /
median) and the bytes written; the pulled DEST is compared with the checkpoint byte for byte in the first round.
Never a test: timings on a shared machine vary.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from sync_bench import fresh  # benchmarks/ is on sys.path when a script there runs

_PUSH = """
import sys, time
from deltafs import push
t = time.perf_counter()
r = push(sys.argv[1], sys.argv[2], cache_dir=sys.argv[3], threads=int(sys.argv[4]), full_level=int(sys.argv[5]))
print(time.perf_counter() - t, r.bytes_written)
"""

_PULL = """
import sys, time
from deltafs import pull
t = time.perf_counter()
r = pull(sys.argv[1], sys.argv[2], threads=int(sys.argv[3]))
print(time.perf_counter() - t, r.bytes_read)
"""


def _run(code: str, *args: str) -> tuple[float, int]:
    out = subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True, text=True)
    seconds, count = out.stdout.split()
    return float(seconds), int(count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args()
    w = fresh(a.work)
    w.mkdir(parents=True)
    rows: dict[int, dict[str, list[Any]]] = {lvl: {"push": [], "pull": []} for lvl in a.levels}
    for r in range(a.rounds):
        for lvl in a.levels[r % len(a.levels):] + a.levels[:r % len(a.levels)]:
            run = fresh(w / "run")
            run.mkdir()
            rows[lvl]["push"].append(_run(_PUSH, str(run / "store"), str(a.checkpoint), str(run / "cache"),
                                          str(a.threads), str(lvl)))
            fresh(run / "cache")
            rows[lvl]["pull"].append(_run(_PULL, str(run / "store"), str(run / "dest"), str(a.threads)))
            if r == 0:
                names = sorted(p.relative_to(a.checkpoint) for p in a.checkpoint.rglob("*") if p.is_file())
                if not all(filecmp.cmp(a.checkpoint / n, run / "dest" / n, shallow=False) for n in names):
                    raise SystemExit(f"level {lvl}: the pulled DEST differs from the checkpoint")
            fresh(Path(str(run / "dest") + ".deltafs"))
            fresh(run)
    size = sum(p.stat().st_size for p in a.checkpoint.rglob("*") if p.is_file())
    print(f"{a.checkpoint}: {size / 1e9:.3f} GB, {a.threads} thread(s), {a.rounds} rounds")
    print("| full_level | push s (least / median) | bytes written | x checkpoint | pull s (least / median) |")
    print("|---|---|---:|---:|---|")
    summary = {}
    for lvl, d in rows.items():
        ps, qs = [x[0] for x in d["push"]], [x[0] for x in d["pull"]]
        written = d["push"][-1][1]
        summary[lvl] = {"push_least": min(ps), "push_median": statistics.median(ps), "bytes_written": written,
                        "pull_least": min(qs), "pull_median": statistics.median(qs)}
        print(f"| {lvl} | {min(ps):.3f} / {statistics.median(ps):.3f} | {written:,} | {written / size:.3f} | "
              f"{min(qs):.3f} / {statistics.median(qs):.3f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "checkpoint_bytes": size,
                                            "cpus": os.cpu_count(), "rows": rows, "summary": summary,
                                            "load": os.getloadavg()}, indent=1) + "\n")
    fresh(w)


if __name__ == "__main__":
    main()
