"""A pull template at a chosen zstd level, as `benchmarks/sync_bench.py run` makes its `tmpl-pull` at the default.

    python benchmarks/pull_template.py BASE NEW OUT --level 5
    python benchmarks/pull_ab.py OUT --tree . --tree /tmp/v0 ...

BASE and NEW are checkpoint directories (a sync_bench data set's `base` and `new`). OUT gets `store/` with an
older version (sync_bench's make_older of BASE), BASE and NEW pushed as versions 1-3 with `deltafs push --level`,
and a DEST (`dest`, `dest.deltafs/`) that pulled versions 1 then 2: pull_ab.py times the update pull of version 3.
Run with the deltafs whose writer is wanted (the console command next to this Python). Never a test.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from sync_bench import deltafs_cli, fresh, make_older  # benchmarks/ is on sys.path when a script there runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--level", type=int, default=3)
    a = ap.parse_args()
    cli = deltafs_cli()
    fresh(a.out).mkdir(parents=True)
    older, cache, store = a.out / "older", a.out / "tmp-cache", a.out / "store"
    make_older(a.base, older)
    for src in (older, a.base, a.new):
        subprocess.run([cli, "push", str(src), str(store), "--cache", str(cache), "--level", str(a.level), "-q"],
                       check=True)
    fresh(cache)
    fresh(older)
    for v in ("1", "2"):
        subprocess.run([cli, "pull", str(store), str(a.out / "dest"), "--version", v, "-q"], check=True)
    print(f"{a.out}: versions 1-3 at level {a.level}, dest at version 2")


if __name__ == "__main__":
    main()
