"""First-order entropy estimate of a delta, the yardstick the codec benchmark and tests measure against."""

from __future__ import annotations

import math

import numpy as np


def delta_entropy_bits(new: np.ndarray, old: np.ndarray, itemsize: int) -> tuple[float, int]:
    """(bits, changed elements) for one tensor: n * H2(p) for which elements changed (p = changed / n, as if each
    changed independently) plus, per changed element, the empirical entropy of the integer difference of the bit
    patterns (new - old, wrapping). Codecs that exploit more context than this can beat it."""
    dtype = np.dtype(f"<u{itemsize}")
    nw, ow = np.ascontiguousarray(new).view(np.uint8).view(dtype), np.ascontiguousarray(old).view(np.uint8).view(dtype)
    idx = np.flatnonzero(nw != ow)
    n, c = nw.size, idx.size
    if c == 0:
        return 0.0, 0
    p = c / n
    h2 = 0.0 if p >= 1 else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))
    _, counts = np.unique(nw[idx] - ow[idx], return_counts=True)
    q = counts / c
    return n * h2 + c * float(-(q * np.log2(q)).sum()), c
