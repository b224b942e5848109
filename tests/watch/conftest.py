"""Fixtures for watcher tests: a store with pushed versions and the SGLang stand-in."""

from __future__ import annotations

import os
import sys
from typing import Iterator

import pytest

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (TESTS_DIR, os.path.dirname(os.path.abspath(__file__))):
    if path not in sys.path:
        sys.path.insert(0, path)

from sglang_standin import StandinSGLang, random_weights, write_checkpoint  # noqa: E402 - after the path set-up
from watch_helpers import CONFIG, Trainer  # noqa: E402


@pytest.fixture()
def trainer(tmp_path) -> Trainer:
    return Trainer(str(tmp_path / "store"), str(tmp_path / "push-cache"))


@pytest.fixture()
def engine_server(tmp_path) -> Iterator[StandinSGLang]:
    """The stand-in, started from an unrelated checkpoint (weight_version "default")."""
    init = write_checkpoint(str(tmp_path / "initial"), random_weights(CONFIG, 0), CONFIG)
    with StandinSGLang(init) as server:
        yield server
