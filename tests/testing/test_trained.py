"""The trained data set: real AdamW steps on a small GPT, exported as bf16 matrices and F32 1-D tensors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deltafs.testing.trained import TrainedRun, changed_fractions, config_for, parse_count


def test_parse_count() -> None:
    assert parse_count("20M") == 20_000_000
    assert parse_count("1.5m") == 1_500_000
    assert parse_count("300k") == 300_000
    assert parse_count("123") == 123
    with pytest.raises(ValueError, match="not a parameter count"):
        parse_count("twenty")


def test_config_matches_model_size() -> None:
    for target in (300_000, 2_000_000, 20_000_000):
        cfg = config_for(target)
        assert 0.5 * target < cfg.num_params() < 1.5 * target


def test_versions_are_deterministic_and_mixed_dtype() -> None:
    cfg = config_for(300_000)
    a = list(TrainedRun(cfg, seed=3, lr=1e-5, warmup_steps=1).versions(2))
    b = list(TrainedRun(cfg, seed=3, lr=1e-5, warmup_steps=1).versions(2))
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        assert all(torch.equal(x[k].view(torch.uint8), y[k].view(torch.uint8)) for k in x)
    dtypes = {k: t.dtype for k, t in a[0].items()}
    assert all(dt == torch.float32 for k, dt in dtypes.items() if a[0][k].dim() == 1)
    assert all(dt == torch.bfloat16 for k, dt in dtypes.items() if a[0][k].dim() > 1)
    assert sum(1 for t in a[0].values() if t.dim() == 1) >= 8 * cfg.n_layers
    frac = changed_fractions(a[0], a[1])
    # Real AdamW: nearly every F32 element moves, a small part of the bf16 ones.
    assert frac["float32"] > 0.9
    assert 0.0 < frac["bfloat16"] < 0.5


def test_cli_writes_versions(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "deltafs.testing.trained", str(out), "--versions", "2",
                           "--params", "300k", "--warmup-steps", "0"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "versions.json").read_text())
    assert [v["dir"] for v in summary["versions"]] == ["v0", "v1"]
    assert 0.0 < summary["versions"][1]["changed"]["all"] < 1.0
    v0, v1 = load_file(out / "v0" / "model.safetensors"), load_file(out / "v1" / "model.safetensors")
    assert v0.keys() == v1.keys() and len(v0) > 10


def test_trained_versions_push_and_pull_bit_exact(tmp_path: Path) -> None:
    """Mostly-changed F32 tensors go through the pipeline as dense deltas and come back byte for byte."""
    import deltafs

    cfg = config_for(300_000)
    run = TrainedRun(cfg, seed=1, lr=1e-6, warmup_steps=1)
    from deltafs.testing.trained import write_version

    for i, tensors in enumerate(run.versions(2)):
        write_version(tmp_path / f"v{i}", tensors, cfg, step=i)
    store = (tmp_path / "store").as_uri()
    first = deltafs.push(store, str(tmp_path / "v0"), cache_dir=str(tmp_path / "cache"))
    second = deltafs.push(store, str(tmp_path / "v1"), cache_dir=str(tmp_path / "cache"))
    assert second.kind == "delta"
    out = tmp_path / "out"
    deltafs.pull(store, str(out), version=first.version)
    deltafs.pull(store, str(out))
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "v1" / "model.safetensors").read_bytes()
