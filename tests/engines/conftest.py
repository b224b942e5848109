"""Make tests/ importable (for the named SGLang stand-in, tests/sglang_standin.py)."""

import os
import sys

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)
