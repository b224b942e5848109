"""deltafs.testing.checkpoints: the safetensors layout a benchmark reads back is where the bytes are."""

from __future__ import annotations

from deltafs.testing.checkpoints import safetensors_layout, write_safetensors


def test_layout_gives_each_tensors_dtype_and_absolute_byte_range(tmp_path):
    path = str(tmp_path / "m.safetensors")
    tensors = {"b": ("BF16", (3,), b"\x01\x02" * 3), "a": ("F32", (2,), b"\x03\x04\x05\x06" * 2)}
    write_safetensors(path, tensors, metadata={"format": "pt"}, pad_header=5)
    layout = safetensors_layout(path)
    assert list(layout) == ["b", "a"]  # header order, __metadata__ left out
    data = open(path, "rb").read()
    for name, (dtype, offset, nb) in layout.items():
        assert dtype == tensors[name][0] and data[offset:offset + nb] == tensors[name][2]
