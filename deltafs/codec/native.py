"""The codec's compiled loops (deltafs/codec/_native.c), where the build could compile them.

setup.py builds the C module as optional: without a C compiler the install goes on without it, and the codec
runs its numpy code for the same streams (the same bytes, more calls per chunk). `enabled` switches between the
two at run time; tests run both on the same streams (tests/codec/test_native.py). DELTAFS_NATIVE=0 in the
environment starts a process with them off, as if they were not built.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

module: ModuleType | None
try:
    from deltafs.codec import _native as module
except ImportError:  # pragma: no cover - depends on the build
    module = None

BUILT = module is not None
# The C loops read and write little-endian integers in the host's order.
enabled = BUILT and sys.byteorder == "little" and os.environ.get("DELTAFS_NATIVE", "1") != "0"


# DELTAFS_SIMD=0, 1 or 2 caps the compare's vector level (to rule the vector loops out, or compare them); anything
# else is ignored.
_SIMD_CAP = os.environ.get("DELTAFS_SIMD", "").strip()
_SIMD_CAP = _SIMD_CAP if _SIMD_CAP in ("0", "1", "2") else ""
# The level passed to the compiled compare: the host's (2 AVX-512, 1 AVX2, 0 none), at most the cap. Tests set it
# like `enabled` (every level gives the same bytes).
simd_level = 0 if module is None else min(module.simd(), int(_SIMD_CAP or 2))


def loops() -> ModuleType | None:
    """The compiled module when it is built and enabled, else None (use numpy)."""
    return module if enabled else None


def describe() -> str:
    """Which loops run and why, for `deltafs env`."""
    if enabled and module is not None:
        capped = " (DELTAFS_SIMD)" if _SIMD_CAP else ""
        return f"compiled, compare {('scalar', 'AVX2', 'AVX-512')[simd_level]}{capped} ({module.__file__})"
    if not BUILT:
        return "numpy (not built: no C compiler at install)"
    if sys.byteorder != "little":
        return "numpy (big-endian host)"
    return "numpy (turned off" + (": DELTAFS_NATIVE=0)" if os.environ.get("DELTAFS_NATIVE") == "0" else ")")
