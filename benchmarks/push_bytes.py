"""The Bytes target of issue 9, measured: what a real delta push writes (chunks plus manifest) against the entropy
estimate, per zstd level, on pairs of checkpoint directories.

    python -m deltafs.testing.trained /tmp/trained-lr6e-07 --versions 2 --params 20M --lr 6e-07   # one pair
    python benchmarks/push_bytes.py /tmp/trained-lr6e-07/v0:/tmp/trained-lr6e-07/v1 [...] --levels 3 5 \
        [--json docs/push_bytes.json]

For every OLD:NEW pair and level: `deltafs.push(OLD)` into a fresh local store, then `deltafs.push(NEW)`; the
second push's `bytes_written` (its chunks plus its manifest, what `deltafs push --json` prints) and its manifest's
stored size. Beside it, over every tensor of the pair's safetensors files: the first-order entropy estimate
(`deltafs.testing.entropy`, as docs/benchmarks.md defines it), the bit-length model (benchmarks/bytes_by_class.py)
and XOR + zstd-1 per tensor. The changed fraction is over all elements. The target: bytes_written <= 1.05x the
entropy estimate at ~1% changed on a ~20M-parameter model.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import tempfile
from typing import Any

import numpy as np
import zstandard

from bytes_by_class import bit_length_model_bytes, tensors  # a sibling script: benchmarks/ is on sys.path
from deltafs import push
from deltafs.format.dtypes import DTYPE_SIZES
from deltafs.testing.entropy import delta_entropy_bits


def yardsticks(old_dir: str, new_dir: str) -> dict[str, float]:
    """Entropy estimate, bit-length model and XOR + zstd-1 (bytes) and the changed fraction over the pair's tensors."""
    z = zstandard.ZstdCompressor(level=1)
    out = {"entropy": 0.0, "bit_length_model": 0.0, "xor_zstd1": 0.0, "changed": 0.0, "elements": 0.0}
    for path in sorted(glob.glob(os.path.join(new_dir, "*.safetensors"))):
        old, new = tensors(os.path.join(old_dir, os.path.basename(path))), tensors(path)
        for name, (dtype, nb) in new.items():
            ob = old[name][1]
            item = DTYPE_SIZES[dtype]
            bits, changed = delta_entropy_bits(nb, ob, item)
            out["entropy"] += bits / 8
            out["bit_length_model"] += bit_length_model_bytes(nb, ob, item)
            out["xor_zstd1"] += len(z.compress(np.bitwise_xor(nb, ob).tobytes()))
            out["changed"] += changed
            out["elements"] += nb.size // item
    return out


def pushed(old_dir: str, new_dir: str, level: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="push-bytes-") as tmp:
        store = os.path.join(tmp, "store")
        push(store, old_dir, level=level)
        result = push(store, new_dir, level=level)
        manifests = sorted(glob.glob(os.path.join(store, "manifests", "*")))
        return {"bytes_written": result.bytes_written, "chunks_written": result.chunks_written,
                "manifest_bytes": os.path.getsize(manifests[-1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pairs", nargs="+", help="OLD:NEW checkpoint directories")
    ap.add_argument("--levels", type=int, nargs="+", default=[3, 5])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    print("| pair | changed | level | bytes_written | manifest | entropy est. | vs entropy | vs bit-length model "
          "| vs XOR+zstd-1 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for pair in args.pairs:
        old_dir, new_dir = pair.split(":", 1)
        ys = yardsticks(old_dir, new_dir)
        for level in args.levels:
            p = pushed(old_dir, new_dir, level)
            row = {"old": old_dir, "new": new_dir, "level": level, **p, **ys,
                   "changed_fraction": ys["changed"] / ys["elements"]}
            rows.append(row)
            print(f"| {new_dir} | {row['changed_fraction'] * 100:.2f}% | {level} | {p['bytes_written']:,} "
                  f"| {p['manifest_bytes']:,} | {ys['entropy']:,.0f} | {p['bytes_written'] / ys['entropy']:.3f}x "
                  f"| {p['bytes_written'] / ys['bit_length_model']:.3f}x | {p['bytes_written'] / ys['xor_zstd1']:.3f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
