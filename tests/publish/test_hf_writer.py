"""The one HF shard writer: the bytes safetensors writes, shards with an index, tied weights accepted."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from deltafs.publish import write_hf_checkpoint


def _mixed() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "b": torch.randn(3, 5).bfloat16(), "a": torch.randn(7), "c": torch.arange(5, dtype=torch.int64),
        "d": torch.ones(3, dtype=torch.bool), "e": torch.randn(4).to(torch.float8_e4m3fn), "f": torch.randn(2).half(),
        "s": torch.tensor(-0.0), "z": torch.zeros(0, 3, dtype=torch.int32), "u": torch.arange(4, dtype=torch.uint8),
        "i16": torch.arange(3, dtype=torch.int16), "f64": torch.randn(2, dtype=torch.float64),
        "t": torch.randn(6, 4).t(),  # not contiguous
    }


def test_a_single_file_is_byte_for_byte_what_safetensors_writes(tmp_path):
    tensors = _mixed()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    assert write_hf_checkpoint(tensors, str(tmp_path / "ours")) == ["model.safetensors"]
    assert (tmp_path / "ours" / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_shards_have_an_index_and_load_back(tmp_path):
    tensors = {f"layer.{i}.weight": torch.full((64,), float(i)) for i in range(6)}
    tensors["tied"] = tensors["layer.0.weight"]  # shares storage: written under both names
    paths = write_hf_checkpoint(tensors, str(tmp_path), max_shard_bytes=600, extra_files={"config.json": b"{}"})
    shards = [p for p in paths if p.endswith(".safetensors")]
    assert shards == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 7 * 64 * 4 and set(index["weight_map"]) == set(tensors)
    loaded = {}
    for name in shards:
        loaded.update(load_file(str(tmp_path / name)))
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())
    assert (tmp_path / "config.json").read_bytes() == b"{}"
