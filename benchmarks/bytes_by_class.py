"""Where a delta's bytes go against the entropy estimate, by tensor class: bf16 matrices and small 1-D F32 tensors.

    python -m deltafs.testing.trained /tmp/trained --versions 2 --params 20M     # or any two safetensors files
    python benchmarks/bytes_by_class.py /tmp/trained/v0/model.safetensors /tmp/trained/v1/model.safetensors [--level 5]

For every tensor: the deltafs codec's payload (`deltafs.codec.encode`, one chunk per tensor up to 4 MiB), XOR +
zstd-1, the first-order entropy estimate of docs/benchmarks.md (`deltafs.testing.entropy`: which elements changed,
plus the empirical entropy of the changed elements' integer differences) and a second yardstick, a *bit-length
model*: per element the entropy of the zigzag difference's bit length (empirical, over the tensor) plus the bits
below its leading one, stored raw. On a tensor of a few hundred elements whose differences are nearly all
distinct, the empirical entropy of the differences is about log2(n) bits whatever their spread, and reads below
what any coder that does not know the values in advance can reach; the bit-length model is such a coder's cost.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from typing import Any

import numpy as np
import zstandard

from deltafs import codec
from deltafs.codec.compare import zigzag
from deltafs.defaults import DEFAULT_LEVEL
from deltafs.format.dtypes import DTYPE_SIZES
from deltafs.testing.checkpoints import safetensors_layout
from deltafs.testing.entropy import delta_entropy_bits

CHUNK = 4 << 20


def tensors(path: str) -> dict[str, tuple[str, np.ndarray]]:
    data = np.fromfile(path, dtype=np.uint8)
    return {name: (dtype, data[offset:offset + nb]) for name, (dtype, offset, nb) in safetensors_layout(path).items()}


def bit_length_model_bytes(new: np.ndarray, old: np.ndarray, itemsize: int) -> float:
    """Bytes of an ideal coder of each element's difference as (bit length, entropy-coded) + (lower bits, raw)."""
    dtype = np.dtype(f"<u{itemsize}")
    zz = zigzag(new.view(dtype) - old.view(dtype))
    bits = np.frexp(zz.astype(np.float64))[1]  # 0 for an unchanged element
    _, counts = np.unique(bits, return_counts=True)
    p = counts / bits.size
    return float(-(p * np.log2(p)).sum() * bits.size + np.maximum(bits - 1, 0).sum()) / 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--small", type=int, default=64 << 10, help="bytes below which a tensor counts as small")
    ap.add_argument("--level", type=int, default=DEFAULT_LEVEL,
                    help=f"the codec's level, as push --level (default {DEFAULT_LEVEL}; from 5 on sparse splits by magnitude)")
    args = ap.parse_args()
    old, new = tensors(args.old), tensors(args.new)
    if old.keys() != new.keys():
        raise SystemExit("the two files do not hold the same tensors")
    z = zstandard.ZstdCompressor(level=1)
    rows: dict[str, dict[str, Any]] = defaultdict(lambda: defaultdict(float))
    for name, (dtype, nb) in new.items():
        odtype, ob = old[name]
        if odtype != dtype or ob.size != nb.size or not nb.size:
            continue
        item = DTYPE_SIZES[dtype]
        cls = f"{dtype} {'< ' if nb.size < args.small else '>= '}{args.small >> 10} KiB"
        r = rows[cls]
        r["tensors"] += 1
        r["bytes"] += nb.size
        bits, changed = delta_entropy_bits(nb, ob, item)
        r["changed"] += changed
        r["elements"] += nb.size // item
        r["entropy"] += bits / 8
        r["bit-length model"] += bit_length_model_bytes(nb, ob, item)
        r["xor+zstd-1"] += len(z.compress((nb ^ ob).tobytes()))
        for start in range(0, nb.size, CHUNK):
            enc = codec.encode(nb[start:start + CHUNK], ob[start:start + CHUNK], item, level=args.level)
            r["deltafs"] += len(enc.payload or b"")
    total: dict[str, float] = defaultdict(float)
    print("| tensors | count | MB | changed | deltafs B | entropy est. B | bit-length model B | XOR+zstd-1 B "
          "| deltafs / entropy | deltafs / bit-length model |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for cls, r in sorted(rows.items()):
        for k, v in r.items():
            total[k] += v
        print(f"| {cls} | {r['tensors']:.0f} | {r['bytes'] / 1e6:.1f} | {r['changed'] / r['elements'] * 100:.2f}% "
              f"| {r['deltafs']:,.0f} | {r['entropy']:,.0f} | {r['bit-length model']:,.0f} | {r['xor+zstd-1']:,.0f} "
              f"| {r['deltafs'] / r['entropy']:.3f}x | {r['deltafs'] / r['bit-length model']:.3f}x |")
    print(f"| all | {total['tensors']:.0f} | {total['bytes'] / 1e6:.1f} | "
          f"{total['changed'] / total['elements'] * 100:.2f}% | {total['deltafs']:,.0f} | {total['entropy']:,.0f} "
          f"| {total['bit-length model']:,.0f} | {total['xor+zstd-1']:,.0f} | {total['deltafs'] / total['entropy']:.3f}x "
          f"| {total['deltafs'] / total['bit-length model']:.3f}x |")


if __name__ == "__main__":
    main()
