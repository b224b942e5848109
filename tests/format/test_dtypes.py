"""The one safetensors dtype table agrees with safetensors' own writer, torch and numpy, and imports neither."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import save

from deltafs.format.dtypes import DTYPE_SIZES, NUMPY_NAMES, TORCH_NAMES, safetensors_name


def _header_dtype(tensor: torch.Tensor) -> str:
    raw = save({"t": tensor})
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n])["t"]["dtype"]


@pytest.mark.parametrize("st_name", sorted(TORCH_NAMES))
def test_torch_names_are_what_safetensors_writes(st_name):
    dtype = getattr(torch, TORCH_NAMES[st_name], None)
    if dtype is None:
        pytest.skip(f"this torch has no {TORCH_NAMES[st_name]}")
    t = torch.zeros(3, dtype=dtype)
    assert _header_dtype(t) == st_name
    assert t.element_size() == DTYPE_SIZES[st_name]
    assert safetensors_name(str(dtype)) == st_name  # "torch.bfloat16" as str(dtype) prints it
    assert safetensors_name(TORCH_NAMES[st_name]) == st_name


@pytest.mark.parametrize("st_name", sorted(NUMPY_NAMES))
def test_numpy_names_have_the_element_size(st_name):
    assert np.dtype(NUMPY_NAMES[st_name]).itemsize == DTYPE_SIZES[st_name]


def test_dtypes_without_a_safetensors_name():
    assert safetensors_name("qint8") is None
    assert safetensors_name("complex128") is None


@pytest.mark.parametrize("name", ["float8_e4m3fnuz", "float8_e5m2fnuz"])
def test_rocm_fp8_tensors_push_and_pull_bit_exact(tmp_path, name):
    """ROCm's fp8 types, which safetensors 0.8 stores as F8_E4M3FNUZ / F8_E5M2FNUZ, were refused ("safetensors
    cannot store"; from a file: "a dtype deltafs does not know")."""
    from safetensors.torch import load_file

    from deltafs.publish import push, push_tensors
    from deltafs.read.pull import pull

    dtype = getattr(torch, name, None)
    if dtype is None:
        pytest.skip(f"this torch has no {name}")
    t = torch.arange(256, dtype=torch.uint8).view(dtype)
    push_tensors(str(tmp_path / "a"), {"w": t})
    pull(str(tmp_path / "a"), str(tmp_path / "da"))
    got = load_file(str(tmp_path / "da" / "model.safetensors"))["w"]
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8))
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(save({"w": t}))
    push(str(tmp_path / "b"), str(src))
    pull(str(tmp_path / "b"), str(tmp_path / "db"))
    assert (tmp_path / "db" / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


def test_the_format_layer_does_not_import_torch():
    code = "import sys, deltafs.format.dtypes; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
