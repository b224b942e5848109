"""Megatron-core with tensor / pipeline parallelism in real processes (gloo on 127.0.0.1).

Each rank runs megatron_worker.py: forward, push_megatron on every rank (rank 0 writes), one Adam
step, forward, push again. Here each version is pulled and a plain-torch HF model built from it must
give the logits the Megatron job computed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.megatron
pytest.importorskip("megatron.core")

import hf_reference  # noqa: E402
import megatron_cpu as mc  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "megatron_worker.py")


def run_job(tmp_path: Any, *, tp: int, pp: int, tiny: mc.Tiny, steps: int, vpp: int | None = None, dp: int = 1,
            dtype: str = "float32", push: dict[str, Any] | None = None,
            rank_tiny: dict[str, Any] | None = None, expect_ok: bool = True,
            **more: Any) -> tuple[dict[str, Any], list[str]]:
    world = tp * pp * dp
    spec = {"tp": tp, "pp": pp, "vpp": vpp, "dtype": dtype, "steps": steps,
            "store": str(tmp_path / "store"), "cache": str(tmp_path / "cache"), "out": str(tmp_path),
            "tiny": {k: v for k, v in asdict(tiny).items() if k != "dtype"}, "rank_tiny": rank_tiny or {},
            "push": push or {}, **more}
    port = mc.free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, json.dumps(spec)], env=mc.env_for_rank(r, world, port),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=180)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        if expect_ok:
            assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{out[-4000:]}"
    return spec, outputs


def check_versions(tmp_path: Any, spec: dict[str, Any], tiny: mc.Tiny, steps: int,
                   tol: float = 1e-4) -> list[torch.Tensor]:
    from deltafs.read.pull import pull

    toks = mc.tokens()
    seen = []
    for step in range(steps + 1):
        result = json.loads((tmp_path / f"push-{step}.json").read_text())
        assert result["version"] == step + 1 and result["metadata"] == {"step": step}
        pulled = pull(spec["store"], str(tmp_path / "dest"), version=step + 1)
        want = torch.load(tmp_path / f"logits-{step}.pt")
        got = hf_reference.logits(pulled.path, toks)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        seen.append(got)
    return seen


@pytest.mark.parametrize("groups, dp, dtype", [(2, 1, "bfloat16"), (1, 2, "float32")],
                         ids=["gqa-group-per-rank-bf16", "mqa-group-split-over-ranks-dp2"])
def test_tp2_push_step_push(tmp_path: Any, groups: int, dp: int, dtype: str) -> None:
    """TP=2: fused QKV split by query groups (or one group split in two), fc1 shards [gate_r; up_r].

    bf16: the published tensors stay bf16 (Megatron computes in bf16, the reference in fp32 from the
    same bf16 weights, hence the wider tolerance; a wrong layout is off by O(1)).
    DP=2: the second replica takes no part in the gather; only global rank 0 gets a PushResult."""
    from safetensors import safe_open

    tiny = mc.Tiny(groups=groups, qkv_bias=True)
    spec, _ = run_job(tmp_path, tp=2, pp=1, tiny=tiny, steps=1, dp=dp, dtype=dtype)
    before, after = check_versions(tmp_path, spec, tiny, steps=1, tol=2e-2 if dtype == "bfloat16" else 1e-4)
    assert (before - after).abs().max() > 1e-1  # the optimizer step changed what was published
    second = json.loads((tmp_path / "push-1.json").read_text())
    assert second["kind"] != "full" and second["bytes_written"] < second["full_bytes"]
    path = os.path.join(tmp_path / "dest")
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as fh:
        assert {fh.get_slice(n).get_dtype() for n in fh.keys()} == {"BF16" if dtype == "bfloat16" else "F32"}


def test_tp2_pp2_virtual_chunks_publish_layers_under_global_indices(tmp_path: Any) -> None:
    """4 ranks, TP=2 x PP=2 x 2 virtual chunks, tied embeddings: stage 0 holds layers 0 and 2, stage 1
    layers 1 and 3 (each numbered from 0 locally); the last stage's copy of the embeddings is not published.

    Pushed with multi_rank=True: each stage writes its own layers (its own safetensors shard)."""
    from safetensors import safe_open

    from deltafs.read.pull import pull

    tiny = mc.Tiny(layers=4, qk_norm=True, tied=True)
    spec, _ = run_job(tmp_path, tp=2, pp=2, vpp=2, tiny=tiny, steps=0, push={"multi_rank": True})
    check_versions(tmp_path, spec, tiny, steps=0)
    path = pull(spec["store"], str(tmp_path / "dest")).path
    names: set[str] = set()
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as fh:
                names |= set(fh.keys())
    assert "lm_head.weight" not in names
    assert {n.split(".")[2] for n in names if n.startswith("model.layers.")} == {"0", "1", "2", "3"}

    # What each stage contributes (the unit of a multi-rank push).
    stages = [set(json.loads((tmp_path / f"stage-{p}.json").read_text())) for p in (0, 1)]
    assert not stages[0] & stages[1] and stages[0] | stages[1] == names
    layers = [{n.split(".")[2] for n in st if n.startswith("model.layers.")} for st in stages]
    assert layers == [{"0", "2"}, {"1", "3"}]
    assert "model.embed_tokens.weight" in stages[0] and "model.norm.weight" in stages[1]

    # The pulled checkpoint has one shard per writer: stage 0 and stage 1 (their first TP ranks).
    shards = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as fh:
                shards[f] = set(fh.keys())
    assert sorted(shards.values(), key=len) == sorted(stages, key=len)
    index = json.loads(open(os.path.join(path, "model.safetensors.index.json")).read())
    assert set(index["weight_map"]) == names


def test_shapes_that_disagree_between_ranks_fail_on_every_rank_before_anything_is_written(tmp_path: Any) -> None:
    """Rank 1 was built with another MLP width: both ranks raise the same clear error, nobody hangs."""
    tiny = mc.Tiny()
    _, outputs = run_job(tmp_path, tp=2, pp=1, tiny=tiny, steps=0, rank_tiny={"1": {"ffn": 128}}, expect_ok=False)
    for out in outputs:
        assert "MegatronLayoutError" in out and "mlp.linear_fc1.weight on TP rank" in out, out[-3000:]
    assert not (tmp_path / "store").exists()


def test_one_rank_refusing_its_options_fails_that_step_everywhere_and_the_next_is_whole(tmp_path: Any) -> None:
    """push_megatron(multi_rank=True) checked its options before any collective: a rank refusing its own (threads=0
    at step 1) left the other in push_distributed's first collective, where its step-2 call met it (review of the
    push_distributed fix). The checks run inside a collective now: step 1 fails on both ranks, step 2 is version 2."""
    from deltafs.store.repo import Repository

    tiny = mc.Tiny()
    run_job(tmp_path, tp=2, pp=1, tiny=tiny, steps=2, push={"multi_rank": True},
            rank_push={"1:1": {"threads": 0}}, continue_on_error=True)
    for rank in (0, 1):
        assert "threads" in (tmp_path / f"error-{rank}-1.txt").read_text(), rank
    repo = Repository.open(str(tmp_path / "store"))
    assert repo.versions() == [1, 2]
    assert [repo.manifest(v).metadata["step"] for v in (1, 2)] == [0, 2]
    assert json.loads((tmp_path / "push-2.json").read_text())["version"] == 2
