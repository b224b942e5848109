"""Make tests/ importable (the stand-ins, tests/sglang_standin.py, and tests/engine_helpers.py); shared fixtures."""

from __future__ import annotations

import os
import sys

import pytest
import torch

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

from sglang_standin import random_weights, tiny_config, write_checkpoint  # noqa: E402 - after the path set-up

from deltafs.engines.base import Target  # noqa: E402

CONFIG = tiny_config()


@pytest.fixture()
def ckpts(tmp_path) -> tuple[Target, dict[str, torch.Tensor], Target, dict[str, torch.Tensor]]:
    """Versions "1" and "2" of the tiny model as checkpoint directories: (v1, weights 1, v2, weights 2)."""
    w1, w2 = random_weights(CONFIG, 1), random_weights(CONFIG, 2)
    return (Target(write_checkpoint(str(tmp_path / "v1"), w1, CONFIG), "1"), w1,
            Target(write_checkpoint(str(tmp_path / "v2"), w2, CONFIG), "2"), w2)
