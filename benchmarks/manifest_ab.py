"""Manifest decode, this tree against another, in one process: what a pull pays to parse and check a manifest.

    git worktree add /tmp/v0 REV
    python benchmarks/manifest_ab.py --other /tmp/v0 --rounds 60 STORED_MANIFEST... [--records 35000,8000]

The other tree's deltafs.format (and deltafs.errors) is imported as deltafs_other beside this one's (codec_ab.py's
load_other). Each round
decodes every given stored manifest (a file under a store's manifests/) and, with --records, a synthetic manifest of
that many chunk records (benchmarks/manifest_scale.py's), with each tree in turn, from a process that has not seen
it (the checked-manifest memo cleared) and after a full garbage collection, so neither pays for the other's
objects. CPU time of the calling thread; least and median. Never a test.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # codec_ab, manifest_scale: beside this script


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("manifests", nargs="*", help="stored manifest files (a store's manifests/v*.json)")
    ap.add_argument("--other", required=True, help="another checkout of deltafs (a git worktree)")
    ap.add_argument("--records", default="", help="also synthetic manifests of these many chunk records")
    ap.add_argument("--rounds", type=int, default=30)
    a = ap.parse_args()
    import deltafs.format.manifest as this
    from codec_ab import load_other
    from manifest_scale import synthetic

    with tempfile.TemporaryDirectory() as work:
        other = load_other(a.other, work, packages=("format",), leaves=("errors.py",), module="format.manifest")
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
