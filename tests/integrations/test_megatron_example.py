"""examples/megatron_push.py's training loop, run on CPU under the test patches (TP=1)."""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("megatron_tp1")]

import hf_reference  # noqa: E402
import megatron_cpu as mc  # noqa: E402

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "megatron_push.py")


@pytest.mark.parametrize("multi_rank", [False, True], ids=["single-writer", "multi-rank"])
def test_example_training_loop_pushes_versions_that_pull_as_qwen3(tmp_path: Any, multi_rank: bool) -> None:
    from deltafs.read.pull import pull

    spec = importlib.util.spec_from_file_location("megatron_push_example", EXAMPLE)
    assert spec and spec.loader
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    torch.manual_seed(0)
    model = example.build_model(layers=2, hidden=64, heads=4, groups=2, ffn=96, device="cpu")
    store = str(tmp_path / "store")
    results = example.train(model, store, steps=2, push_every=1, seq=16, batch=2, cache_dir=str(tmp_path / "cache"),
                            multi_rank=multi_rank)
    assert [r.version for r in results] == [1, 2, 3]
    assert results[0].kind == "full" and all(r.bytes_written < r.full_bytes for r in results[1:])

    pulled = pull(store, str(tmp_path / "dest"))
    assert pulled.version == 3
    cfg = json.loads(open(os.path.join(pulled.path, "config.json")).read())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["vocab_size"] == 1000 and cfg["eos_token_id"] == 2
    toks = mc.tokens(vocab=1000)
    with torch.no_grad():
        want = mc.forward(model, toks)[..., :1000]
    torch.testing.assert_close(hf_reference.logits(pulled.path, toks), want, rtol=1e-4, atol=1e-4)
