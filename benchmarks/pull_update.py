"""Update pull of one version over the one before it, timed as a user runs it (the CLI in a subprocess).

    python benchmarks/pull_update.py prepare --work /tmp/pullbench --base BASE_DIR --new NEW_DIR
    python benchmarks/pull_update.py run --work /tmp/pullbench [--repeat 3] [--threads N] [--profile out.svg]
    PYTHONPATH=/tmp/old-release python benchmarks/pull_update.py run ...   # the same with another release's code

prepare pushes BASE then NEW into WORK/store and pulls BASE into a template DEST; run copies the
template to WORK/dest, times `deltafs.read.pull.pull(WORK/store, WORK/dest)` in a fresh process (BASE -> NEW), checks every file
against NEW byte for byte (sha256), and times `cp -r NEW` in the same run as the anchor.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "deltafs.cli.main", *args]


def _digests(path: str) -> dict[str, str]:
    out = {}
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            full = os.path.join(dirpath, name)
            h = hashlib.sha256()
            with open(full, "rb") as fh:
                while block := fh.read(8 << 20):
                    h.update(block)
            out[os.path.relpath(full, path)] = h.hexdigest()
    return out


def prepare(args: argparse.Namespace) -> None:
    work = args.work
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    store = os.path.join(work, "store")
    for src in (args.base, args.new):
        subprocess.run(_cli("push", src, store, "--cache", os.path.join(work, "push-cache")), check=True)
    subprocess.run(_cli("pull", store, os.path.join(work, "tmpl", "dest"), "--version", "1"), check=True)
    with open(os.path.join(work, "info.json"), "w") as fh:
        json.dump({"base": args.base, "new": args.new, "digests": _digests(args.new)}, fh)


def _drop_caches_hint() -> None:
    os.sync()


def run(args: argparse.Namespace) -> None:
    work = args.work
    info = json.load(open(os.path.join(work, "info.json")))
    rows = []
    for _ in range(args.repeat):
        dest_root = os.path.join(work, "run")
        shutil.rmtree(dest_root, ignore_errors=True)
        subprocess.run(["cp", "-a", os.path.join(work, "tmpl"), dest_root], check=True)
        _drop_caches_hint()
        # The library call the CLI makes; PYTHONPATH may point at another release's tree to compare.
        code = ("import sys; from deltafs.read.pull import pull; "
                f"pull(sys.argv[1], sys.argv[2], threads={args.threads or None})")
        cmd = [sys.executable, "-c", code, os.path.join(work, "store"), os.path.join(dest_root, "dest")]
        if args.profile:
            cmd = ["py-spy", "record", "--threads", "--idle", "--format", "raw" if args.profile.endswith(".txt") else "flamegraph", "-o", args.profile, "--", *cmd]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.monotonic()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=work)  # not the source tree: PYTHONPATH decides
        pull_s = time.monotonic() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        # CPU seconds of the pull process: steadier than wall time on a shared machine.
        cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        got = _digests(os.path.join(dest_root, "dest"))
        assert got == info["digests"], "pulled files differ from the source"
        cp_dst = os.path.join(work, "cp-copy")
        shutil.rmtree(cp_dst, ignore_errors=True)
        _drop_caches_hint()
        t0 = time.monotonic()
        subprocess.run(["cp", "-r", info["new"], cp_dst], check=True)
        os.sync()
        cp_s = time.monotonic() - t0
        shutil.rmtree(cp_dst, ignore_errors=True)
        rows.append({"pull_s": round(pull_s, 3), "pull_cpu_s": round(cpu_s, 3), "cp_r_s": round(cp_s, 3),
                     "ratio": round(pull_s / cp_s, 2)})
        print(json.dumps(rows[-1]), flush=True)
    best = min(rows, key=lambda r: r["pull_s"])
    print(json.dumps({"best": best, "runs": rows}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--work", required=True)
    p.add_argument("--base", required=True)
    p.add_argument("--new", required=True)
    r = sub.add_parser("run")
    r.add_argument("--work", required=True)
    r.add_argument("--repeat", type=int, default=3)
    r.add_argument("--threads", type=int, default=0)
    r.add_argument("--profile", default="")
    args = parser.parse_args()
    {"prepare": prepare, "run": run}[args.cmd](args)


if __name__ == "__main__":
    main()
