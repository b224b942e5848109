"""The word checksum of a tensor's bytes, computed the same on the host (numpy) and on any torch device.

It detects accidents (a stray write, a bad copy, a stale buffer), not adversaries: the files themselves are checked
with xxh3-128 against their manifest. The torch engine checks what a module holds with it (deltafs.engines.torch_module)
and a push with a DeviceBaseline checks each range it rebuilt on the host from changed elements
(deltafs.publish.device_diff). torch is imported only by the device functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

_MASK = (1 << 64) - 1
_ROW = 1024  # 64-bit words per row of the 2-D view a checksum reduces


def _torch() -> Any:
    import torch

    return torch


# The numpy integer dtype of each element size, as int_dtype gives torch's: elements compared and copied as integers
# keep NaN payloads and signed zeros bit-exact.
NP_INT_OF_SIZE: dict[int, np.dtype[Any]] = {1: np.dtype("u1"), 2: np.dtype("<i2"), 4: np.dtype("<i4"), 8: np.dtype("<i8")}


def int_dtype(itemsize: int) -> Any:
    """The torch integer dtype of this element size (uint8, int16, int32, int64)."""
    t = _torch()
    return {1: t.uint8, 2: t.int16, 4: t.int32, 8: t.int64}[itemsize]


# C(bytes) = sum over the 64-bit little-endian words y_i of (2i+1)*y_i, plus, for the last bytes that do not fill a
# word, (2(W+j)+1)*z_j over their elements z_j read as unsigned integers, all modulo 2**64. Integer sums modulo 2**64
# do not depend on the order of the additions, so every device and numpy agree exactly. The weights are odd, hence
# invertible modulo 2**64: a change of any single word (or tail element) always changes C. Viewing the words as a
# [R, 1024] matrix, C = 2*1024*sum_r(r*rowsum_r) + sum_c((2c+1)*colsum_c): two plain sums over the data, no
# temporaries the size of the tensor.

def host_checksum(data: np.ndarray, itemsize: int) -> int:
    """The checksum of a tensor's raw bytes (a 1-D uint8 array), computed with numpy on the host."""
    n = data.size
    words_n = n // 8
    words = data[: words_n * 8].view("<u8")
    rows = words_n // _ROW
    acc = 0
    if rows:
        mat = words[: rows * _ROW].reshape(rows, _ROW)
        row_sums = mat.sum(axis=1, dtype=np.uint64)
        col_sums = mat.sum(axis=0, dtype=np.uint64)
        acc += 2 * _ROW * int((np.arange(rows, dtype=np.uint64) * row_sums).sum(dtype=np.uint64))
        acc += int((np.arange(1, 2 * _ROW, 2, dtype=np.uint64) * col_sums).sum(dtype=np.uint64))
    rest = words[rows * _ROW:]
    if rest.size:
        weights = np.arange(2 * rows * _ROW + 1, 2 * words_n + 1, 2, dtype=np.uint64)
        acc += int((weights * rest).sum(dtype=np.uint64))
    tail = data[words_n * 8:]
    if tail.size:
        values = tail.view(f"<u{itemsize}").astype(np.uint64)
        weights = np.arange(2 * words_n + 1, 2 * (words_n + values.size) + 1, 2, dtype=np.uint64)
        acc += int((weights * values).sum(dtype=np.uint64))
    return acc & _MASK


def int_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as same-size integers, flat; a view of the same memory when t is contiguous."""
    flat = t.detach().reshape(-1)  # a copy only when t is not contiguous
    return flat.view(int_dtype(t.element_size()))


def checksum_on_device(t: torch.Tensor) -> torch.Tensor:
    """The checksum of t's bytes as a 0-d int64 tensor on t's device (the same function as host_checksum)."""
    th = _torch()
    u = int_view(t)
    dev = u.device
    per_word = 8 // t.element_size()
    words_n = u.numel() // per_word
    acc = th.zeros((), dtype=th.int64, device=dev)
    if words_n:
        body = u[: words_n * per_word]
        try:
            words = body.view(th.int64)
        except RuntimeError:  # storage offset not 8-byte aligned (a view into a flat buffer): realign by a copy
            words = body.clone().view(th.int64)
        rows = words_n // _ROW
        if rows:
            mat = words[: rows * _ROW].view(rows, _ROW)
            row_w = th.arange(rows, dtype=th.int64, device=dev)
            col_w = th.arange(1, 2 * _ROW, 2, dtype=th.int64, device=dev)
            # int64 products and sums wrap modulo 2**64 on every backend, like numpy's uint64
            acc = acc + (row_w * mat.sum(1)).sum() * (2 * _ROW) + (col_w * mat.sum(0)).sum()
        if words_n > rows * _ROW:
            weights = th.arange(2 * rows * _ROW + 1, 2 * words_n + 1, 2, dtype=th.int64, device=dev)
            acc = acc + (weights * words[rows * _ROW:]).sum()
    tail = u[words_n * per_word:]
    if tail.numel():
        values = tail.to(th.int64) & ((1 << (8 * t.element_size())) - 1)
        weights = th.arange(2 * words_n + 1, 2 * (words_n + tail.numel()) + 1, 2, dtype=th.int64, device=dev)
        acc = acc + (weights * values).sum()
    result: torch.Tensor = acc
    return result


def device_checksums(tensors: list[torch.Tensor]) -> list[int]:
    """host_checksum of each tensor's bytes, computed where the tensor lives; one transfer of the results per device."""
    th = _torch()
    out: list[int] = [0] * len(tensors)
    by_device: dict[Any, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    with th.no_grad():
        for positions in by_device.values():
            sums = th.stack([checksum_on_device(tensors[i]) for i in positions]).tolist()
            for i, s in zip(positions, sums, strict=True):
                out[i] = int(s) & _MASK
    return out


__all__ = ["NP_INT_OF_SIZE", "checksum_on_device", "device_checksums", "host_checksum", "int_dtype", "int_view"]
