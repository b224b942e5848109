"""Fixtures for the Megatron-core integration tests: real megatron-core on CPU with gloo.

The CPU patches megatron-core needs live in megatron_cpu.py (so spawned ranks can use them too) and
are active only inside these fixtures; the library itself patches nothing.
"""

from __future__ import annotations

import os
import sys
from typing import Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # megatron_cpu, hf_reference, megatron_worker


@pytest.fixture(scope="module")
def megatron_tp1() -> Iterator[None]:
    """A one-rank gloo group with megatron's parallel state at TP=1, PP=1, and the CPU patches on."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist

    import megatron_cpu

    if dist.is_initialized():
        pytest.fail("another test left a torch.distributed process group open; destroy it in that test")
    with megatron_cpu.cpu_patches():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            megatron_cpu.init_parallel(tp=1, pp=1)
            yield
        finally:
            megatron_cpu.destroy_parallel()
            dist.destroy_process_group()
