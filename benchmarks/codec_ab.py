"""Two trees' chunk codecs side by side in one process, against XOR + zstd-1, on the chunks of a checkpoint pair.

    python benchmarks/codec_ab.py --base BASE.safetensors --new NEW.safetensors --other /tmp/old-tree --rounds 15
    python benchmarks/codec_ab.py --full --new NEW.safetensors --other /tmp/old-tree --rounds 5

For a codec change that keeps the format (or, with --other-bytes, one that stores other payloads, whose bytes per
class are then printed and whose classes are this tree's codecs): the other tree's `deltafs.codec` (with the two leaf modules it
imports, `deltafs.errors` and `deltafs.defaults`) is copied under another package name and imported beside this
tree's, so both run on the same arrays in the same process, interleaved round by round. Separate processes of
the same code differ by up to 40% on this VM (heap layout, page faults), more than most codec changes.

Every tensor is cut into 4 MiB pieces, as a store does. Each round times, in one worker thread (as push and pull
run the codec), CPU seconds of that thread: this tree's encode and decode, the other tree's, and XOR + zstd-1
(np.bitwise_xor, one zstd level-1 frame; decode: decompress, XOR into the base). Decodes write in place into a
copy of the base, as a pull does. Both trees must produce byte-identical payloads (checked); the decoded chunks
must equal the new ones (checked). Per codec class (sparse, dense, other), the least and the median of the
rounds are printed.

--full encodes every piece of --new against no base, as a full version (keyframe) stores it (the raw codec), and
the anchor becomes plain zstd-1 of the piece (decode: decompress into the output); --base is then not read.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

import numpy as np
import zstandard

from deltafs import codec as this_codec
from deltafs.testing.checkpoints import safetensors_layout
from gil_check import CHUNK, chunks_of, load  # a sibling script: benchmarks/ is on sys.path when this one runs


def load_other(tree: str, work: str, packages: tuple[str, ...] = ("codec",),
               leaves: tuple[str, ...] = ("errors.py", "defaults.py"), module: str = "codec") -> ModuleType:
    """The other tree's deltafs.<module>, imported as deltafs_other.<module>: its `packages` and `leaves` are copied
    under work/deltafs_other with their imports of deltafs.* rewritten (also used by manifest_ab.py)."""
    pkg = os.path.join(work, "deltafs_other")
    os.makedirs(pkg)
    open(os.path.join(pkg, "__init__.py"), "w").close()
    src = os.path.join(tree, "deltafs")
    for sub in packages:
        shutil.copytree(os.path.join(src, sub), os.path.join(pkg, sub), ignore=shutil.ignore_patterns("__pycache__"))
    for leaf in leaves:
        shutil.copy(os.path.join(src, leaf), os.path.join(pkg, leaf))
    allowed = "|".join(list(packages) + [leaf.removesuffix(".py") for leaf in leaves])
    for root, _, files in os.walk(pkg):
        for name in files:
            if not name.endswith(".py"):  # a compiled extension (codec/_native) is copied as it is
                continue
            path = os.path.join(root, name)
            with open(path) as f:
                text = f.read()
            # Only the import statements: "deltafs." also occurs in strings (the manifest's "deltafs.manifest").
            text = re.sub(r"^(\s*)(from|import) deltafs\.", r"\1\2 deltafs_other.", text, flags=re.M)
            if re.search(rf"^\s*(from|import)\s+deltafs_other\.(?!{allowed})", text, re.M):
                raise SystemExit(f"{path}: the other tree's {module} imports more of deltafs than this script copies")
            with open(path, "w") as f:
                f.write(text)
    sys.path.insert(0, work)
    return importlib.import_module(f"deltafs_other.{module}")


def pieces(base: str, new: str) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """(base piece, new piece, itemsize) of every 4 MiB piece of every tensor; both files share one layout."""
    if safetensors_layout(base) != safetensors_layout(new):
        raise SystemExit("base and new differ in layout")
    layout = chunks_of(new)
    return list(zip(load(base, layout), load(new, layout), (itemsize for _, _, itemsize in layout), strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="the base version (not with --full)")
    ap.add_argument("--new", required=True)
    ap.add_argument("--other", required=True, help="root of the other tree (a git worktree)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--full", action="store_true", help="full-version chunks (no base): the raw codec vs zstd-1")
    ap.add_argument("--level", type=int, default=this_codec.DEFAULT_LEVEL, help="the codecs' zstd level (both trees)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--other-bytes", action="store_true",
                    help="a format change: the trees may store different payloads (each decodes its own; bytes shown)")
    args = ap.parse_args()
    if (args.base is None) != args.full:
        ap.error("give --base, or --full without it")

    work = tempfile.mkdtemp(prefix="codec-ab-")
    try:
        other = load_other(args.other, work)
        items = pieces(args.new if args.full else args.base, args.new)
        # Full: every piece against no base; what the pieces are decoded over is then junk, not a base.
        bases = [None if args.full else b for b, _, _ in items]
        impls: dict[str, Any] = {"this": this_codec, "other": other}
        encoded = {name: [c.encode(n, bases[k], w, level=args.level) for k, (_, n, w) in enumerate(items)]
                   for name, c in impls.items()}
        for a, b in zip(encoded["this"], encoded["other"], strict=True):
            if (a.codec != b.codec or a.payload != b.payload) and not args.other_bytes:
                raise SystemExit("the two trees encode a chunk differently: not a format-preserving change "
                                 "(--other-bytes compares them anyway)")
        classes = [e.codec["name"] if e.codec["name"] in ("sparse", "dense", "gamma") else "other"
                   for e in encoded["this"]]
        cctx, dctx = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
        frames = [cctx.compress(n if args.full else np.bitwise_xor(n, b)) for b, n, _ in items]
        buf = np.empty(CHUNK, np.uint8)

        def run(what: str, impl: str, sel: list[int]) -> float:
            spent = 0.0
            for k in sel:
                b, n, w = items[k]
                out = buf[:b.size]
                if what == "decode":
                    np.copyto(out, b)
                start = time.thread_time()
                if impl == "xor" and args.full:
                    if what == "encode":
                        cctx.compress(n)
                    else:
                        np.copyto(out, np.frombuffer(dctx.decompress(frames[k]), np.uint8))
                elif impl == "xor":
                    if what == "encode":
                        cctx.compress(np.bitwise_xor(n, b))
                    else:
                        np.bitwise_xor(np.frombuffer(dctx.decompress(frames[k]), np.uint8), out, out=out)
                elif what == "encode":
                    impls[impl].encode(n, bases[k], w, level=args.level)
                else:
                    e = encoded[impl][k]
                    # In place over the base, as a pull decodes; a full version's chunk has none.
                    impls[impl].decode(e.codec, e.payload, None if args.full else out, out.size, w, out=out)
                spent += time.thread_time() - start
                if what == "decode" and not np.array_equal(out, n):
                    raise SystemExit(f"{impl} decoded chunk {k} wrongly")
            return spent

        groups = {cls: [k for k, c in enumerate(classes) if c == cls] for cls in ("sparse", "dense", "gamma", "other")}
        groups = {cls: sel for cls, sel in groups.items() if sel}
        groups["all"] = list(range(len(items)))
        names = ["this", "other", "xor"]
        times: dict[str, dict[str, dict[str, list[float]]]] = {
            g: {w: {i: [] for i in names} for w in ("encode", "decode")} for g in groups}

        def rounds() -> None:
            for r in range(args.rounds):
                order = names if r % 2 == 0 else names[::-1]
                for g, sel in groups.items():
                    for what in ("encode", "decode"):
                        for impl in order:
                            times[g][what][impl].append(run(what, impl, sel))

        # In a worker thread, as push and pull run the codec: glibc trims the main thread's heap after large
        # frees, and the next multi-MB temporaries fault in fresh pages (docs/profile.md, round 9).
        with ThreadPoolExecutor(1) as pool:
            pool.submit(rounds).result()

        result: dict[str, Any] = {"base": None if args.full else args.base, "new": args.new, "full": args.full,
                                  "other": args.other, "rounds": args.rounds, "level": args.level,
                                  "loadavg": os.getloadavg(), "classes": {}}
        print(f"{len(items)} pieces; CPU ms of one thread, least / median of {args.rounds} rounds")
        for g, sel in groups.items():
            stored = {i: sum(len(encoded[i][k].payload or b"") for k in sel) for i in ("this", "other")}
            result["classes"].setdefault(g, {})["bytes"] = stored
            print(f"{g}: payload bytes, this tree {stored['this']:,}, other tree {stored['other']:,} "
                  f"({stored['this'] / max(stored['other'], 1):.3f}x)")
        anchor = "zstd-1" if args.full else "XOR+zstd-1"
        print(f"| chunks | step | this tree | other tree | this / other (least) | {anchor} | {anchor} / this (least) |")
        print("|---|---|---|---|---|---|---|")
        for g, sel in groups.items():
            result["classes"][g]["chunks"] = len(sel)
            for what in ("encode", "decode"):
                row = {i: (min(v) * 1e3, statistics.median(v) * 1e3) for i, v in times[g][what].items()}
                result["classes"][g][what] = {i: {"least_ms": a, "median_ms": m} for i, (a, m) in row.items()}
                print(f"| {g} ({len(sel)}) | {what} | {row['this'][0]:.2f} / {row['this'][1]:.2f} | "
                      f"{row['other'][0]:.2f} / {row['other'][1]:.2f} | {row['this'][0] / row['other'][0]:.3f} | "
                      f"{row['xor'][0]:.2f} / {row['xor'][1]:.2f} | {row['xor'][0] / row['this'][0]:.2f}x |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
