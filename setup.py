"""The one compiled part of deltafs: an optional C module for the sparse codec's loops (deltafs/codec/_native.c).

Everything else is in pyproject.toml. Where no C compiler is available the build skips the module and deltafs
uses its numpy code for the same streams (same bytes, slower on small chunks).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("deltafs.codec._native", ["deltafs/codec/_native.c"], libraries=["m"], optional=True)])
