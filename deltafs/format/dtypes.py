"""safetensors dtype names and their element sizes in bytes."""

from __future__ import annotations

# Sub-byte packed types (F4, F6_*) are stored as bytes; the codec treats them with itemsize 1.
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "F8_E4M3FNUZ": 1,  # ROCm's fp8 types (safetensors 0.8)
    "F8_E5M2FNUZ": 1,
    "F4": 1,
    "F6_E2M3": 1,
    "F6_E3M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "C64": 8,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}

# Bits per element for the packed types, whose byte size is not shape * itemsize.
PACKED_BITS: dict[str, int] = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


def itemsize(dtype: str) -> int:
    """Element size the codec works with (1 for packed sub-byte types)."""
    return DTYPE_SIZES[dtype]


def nbytes(dtype: str, shape: tuple[int, ...] | list[int]) -> int:
    """Bytes a tensor of this dtype and shape occupies in a safetensors file."""
    count = 1
    for dim in shape:
        count *= int(dim)
    if dtype in PACKED_BITS:
        return (count * PACKED_BITS[dtype] + 7) // 8
    return count * DTYPE_SIZES[dtype]


# safetensors dtype -> the torch attribute name of the same element type, by name only (format/ never imports torch;
# callers resolve it with getattr(torch, name), which is None on a torch too old to have it). The packed sub-byte
# types have no torch dtype and are absent.
TORCH_NAMES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "C64": "complex64",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
}

# The inverse: torch dtype name (str(dtype) without "torch.") -> safetensors dtype.
SAFETENSORS_NAMES: dict[str, str] = {torch_name: st for st, torch_name in TORCH_NAMES.items()}

# numpy has the same element types under the same names, except bf16 and the fp8 types.
NUMPY_NAMES: dict[str, str] = {st: name for st, name in TORCH_NAMES.items() if st != "BF16" and not st.startswith("F8")}


def safetensors_name(torch_dtype_name: str) -> str | None:
    """The safetensors dtype of a torch dtype given by name ("bfloat16" or "torch.bfloat16"), or None."""
    return SAFETENSORS_NAMES.get(torch_dtype_name.removeprefix("torch."))
