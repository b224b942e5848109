"""The compiled parts of deltafs, both optional: the sparse codec's loops (deltafs/codec/_native.c) and read-only
views of a file's page cache guarded against SIGBUS (deltafs/_mapped.c, Linux).

Everything else is in pyproject.toml. Where no C compiler is available the build skips them: deltafs then uses its
numpy code for the same streams (same bytes, slower on small chunks), and reads large chunks with pread instead of
mapping them.
"""

from setuptools import Extension, setup

setup(ext_modules=[
    # No fused multiply-adds: choose_split's estimate must round like the numpy path's (deltafs/codec/codecs.py).
    Extension("deltafs.codec._native", ["deltafs/codec/_native.c"], libraries=["m"], optional=True,
              extra_compile_args=["-ffp-contract=off"]),
    Extension("deltafs._mapped", ["deltafs/_mapped.c"], optional=True),
])
