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
