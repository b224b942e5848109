"""Manifest decode, this tree against another, in one process: what a pull pays to parse and check a manifest.

    git worktree add /tmp/v0 REV
    python benchmarks/manifest_ab.py --other /tmp/v0 --rounds 60 STORED_MANIFEST... [--records 35000,8000]

The other tree's deltafs.format (and deltafs.errors) is imported as deltafs_other beside this one's. Each round
decodes every given stored manifest (a file under a store's manifests/) and, with --records, a synthetic manifest of
that many chunk records (benchmarks/manifest_scale.py's), with each tree in turn, from a process that has not seen
it (the checked-manifest memo cleared) and after a full garbage collection, so neither pays for the other's
objects. CPU time of the calling thread; least and median. Never a test.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # manifest_scale, beside this script


def import_other(tree: str, work: str) -> Any:
    """The other tree's deltafs.format.manifest, imported as deltafs_other.format.manifest."""
    pkg = os.path.join(work, "deltafs_other")
    os.makedirs(pkg)
    open(os.path.join(pkg, "__init__.py"), "w").close()
    src = os.path.join(tree, "deltafs")
    shutil.copytree(os.path.join(src, "format"), os.path.join(pkg, "format"), ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(src, "errors.py"), os.path.join(pkg, "errors.py"))
    for root, _, files in os.walk(pkg):
        for name in files:
            path = os.path.join(root, name)
            with open(path) as f:
                text = f.read()
            # Only the import statements: "deltafs." also occurs in format strings such as "deltafs.manifest".
            text = re.sub(r"^(\s*)(from|import) deltafs\.", r"\1\2 deltafs_other.", text, flags=re.M)
            if re.search(r"^\s*(from|import)\s+deltafs_other\.(?!format|errors)", text, re.M):
                raise SystemExit(f"{path}: the other tree's format/ imports more of deltafs than this script copies")
            with open(path, "w") as f:
                f.write(text)
    sys.path.insert(0, work)
    return importlib.import_module("deltafs_other.format.manifest")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("manifests", nargs="*", help="stored manifest files (a store's manifests/v*.json)")
    ap.add_argument("--other", required=True, help="another checkout of deltafs (a git worktree)")
    ap.add_argument("--records", default="", help="also synthetic manifests of these many chunk records")
    ap.add_argument("--rounds", type=int, default=30)
    a = ap.parse_args()
    import deltafs.format.manifest as this
    from manifest_scale import synthetic

    with tempfile.TemporaryDirectory() as work:
        other = import_other(a.other, work)
        inputs = [(p, open(p, "rb").read()) for p in a.manifests]
        inputs += [(f"synthetic, {n} records", synthetic(int(n)).sealed().encode())
                   for n in a.records.split(",") if n]
        print("| manifest | other: least / median ms | this: least / median ms | this / other, median |")
        print("|---|---:|---:|---:|")
        for label, data in inputs:
            times: dict[str, list[float]] = {"other": [], "this": []}
            for _ in range(a.rounds):
                for name, mod in (("other", other), ("this", this)):
                    other._CHECKED.clear()
                    this._CHECKED.clear()
                    gc.collect()
                    t0 = time.thread_time()
                    mod.Manifest.decode(data)
                    times[name].append(time.thread_time() - t0)
            o, t = times["other"], times["this"]
            print(f"| {label} | {min(o) * 1e3:.2f} / {statistics.median(o) * 1e3:.2f} | "
                  f"{min(t) * 1e3:.2f} / {statistics.median(t) * 1e3:.2f} | "
                  f"{statistics.median(t) / statistics.median(o):.2f}x |")


if __name__ == "__main__":
    main()
