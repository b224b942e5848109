"""The one HF safetensors shard writer: name → tensor in, safetensors shards (+ index) as files or as bytes.

`plan_checkpoint` lays the tensors out once; the same plan is either written to a directory
(`write_hf_checkpoint`) or streamed into a push without touching the disk (`HfCheckpoint.pieces`).
A shard's bytes are what `safetensors.torch.save_file` writes for the same tensors (dtype-descending,
then name order; header padded with spaces to 8 bytes), except that tensors sharing storage (tied
weights) are accepted and written once per name.
"""

from __future__ import annotations

import json
import os
import struct
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from deltafs.errors import UsageError, check_count
from deltafs.format.dtypes import safetensors_name
from deltafs.format.manifest import path_clash
from deltafs.format.records import is_unicode
from deltafs.publish.device_diff import DeviceBaseline, Known, VersionId, Writing
from deltafs.publish.devices import lazy_torch, wait_for_devices
from deltafs.publish.source import Piece, is_range_bytes  # Piece: host bytes, or RangeBytes such as DeviceBytes

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_SHARD_BYTES = 5 << 30

# safetensors' Dtype enum order (safetensors/src/tensor.rs); shards list tensors by it, descending, so
# every tensor is aligned to its own item size.
_DTYPE_ORDER = ["BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16",
                "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64"]
_RANK = {name: i for i, name in enumerate(_DTYPE_ORDER)}


def shard_file_name(index: int, count: int) -> str:
    """HF's sharded-checkpoint file name, 1-based: model-00001-of-00003.safetensors."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def torch_dtype_name(dtype: Any) -> str | None:
    """The safetensors name of a torch dtype, or None if safetensors cannot store it (deltafs.format.dtypes)."""
    return safetensors_name(str(dtype))


def host_bytes(t: Any) -> np.ndarray:
    """A tensor's bytes on the host as a flat uint8 array (no copy for a contiguous CPU tensor).

    A DTensor (FSDP2, tensor parallel) is gathered with full_tensor(): a collective over its mesh.
    """
    t = _plain_tensor(t)
    if t.device.type != "cpu":
        t = t.to("cpu")
    flat: np.ndarray = t.contiguous().reshape(-1).view(lazy_torch().uint8).numpy()
    return flat


def _plain_tensor(t: Any) -> Any:
    """t detached, a DTensor gathered first (full_tensor(): a collective, on the calling thread); UsageError if t is
    not a tensor."""
    if type(t).__name__ == "DTensor":
        t = t.full_tensor()
    if not isinstance(t, lazy_torch().Tensor):
        raise UsageError(f"expected a torch.Tensor, got {type(t).__name__}")
    t = t.detach()
    # A lazily conjugated or negated view (x.conj(), x.neg() of a view) has no bytes of its own to view:
    # materialize them (a copy only for such a view).
    return t.resolve_conj().resolve_neg() if t.is_conj() or t.is_neg() else t


class DeviceBytes:
    """The bytes of a contiguous tensor on an accelerator, copied to host memory one range at a time when read.

    A push's workers read each chunk when they encode it (again if a fold is written), so host memory holds the
    chunks in flight instead of the whole model, and the device-to-host copies run in the workers instead of all
    before the first chunk. The copies run on each worker thread's own stream: collect_tensors first waits for
    the work already queued on the device. The tensor must not change until the push returns (as for host
    tensors, which a push reads in place).
    """

    def __init__(self, t: Any, baseline: DeviceBaseline | None = None, name: str = "") -> None:
        self._flat = t.reshape(-1).view(lazy_torch().uint8)
        self.nbytes = int(self._flat.numel())
        self.device = str(t.device)
        self._baseline = baseline
        self._slot = baseline.slot(name, self._flat, t.element_size()) if baseline is not None else None

    def read(self, start: int, size: int, out: np.ndarray | None = None) -> np.ndarray:
        """A private host copy of bytes [start, start + size): into out[:size] when given (a reused buffer: a
        fresh multi-MB array per chunk costs page faults), else a new array. torch copies release the GIL."""
        return self.read_against(start, size, out, None, None)[0]

    def read_against(self, start: int, size: int, out: np.ndarray | None, base: Any,
                     versions: tuple[VersionId | None, Writing] | None) -> tuple[np.ndarray, Known | None]:
        """read(), for a push's encode: base is the range's bytes in the push's base version on the host (or None),
        versions (base version, version being written). With a DeviceBaseline that holds that base version the
        range may be rebuilt from its changed elements instead of copied whole (deltafs.publish.device_diff),
        which are returned too (codec.encode's `known`)."""
        if start < 0 or size < 0 or start + size > self.nbytes:
            raise ValueError(f"range [{start}, {start + size}) outside a tensor of {self.nbytes} bytes")
        src = self._flat[start:start + size]
        if self._baseline is not None and self._slot is not None:
            dst = np.empty(size, np.uint8) if out is None else out[:size]
            return self._baseline.read(self._slot, src, start, dst, base, versions)
        if out is None:
            fresh: np.ndarray = src.to("cpu", copy=True).numpy()
            return fresh, None
        dst = out[:size]
        lazy_torch().from_numpy(dst).copy_(src)
        return dst, None


class StridedBytes:
    """The bytes of a non-contiguous tensor (a transposed, sliced or expanded view) in row-major order, copied to
    host memory one range at a time when read, as DeviceBytes does: a contiguous copy of each such tensor up front
    held a second copy of them all for the whole push (adversarial pass: +1.1 GiB of RSS for 1 GiB of transposed
    views). Only the rows a range touches are copied, straight into the reader's buffer. Works on any device."""

    def __init__(self, t: Any) -> None:
        self._t = t
        self.itemsize = int(t.element_size())
        self.nbytes = int(t.numel()) * self.itemsize
        self.device = str(t.device)

    def read(self, start: int, size: int, out: np.ndarray | None = None) -> np.ndarray:
        if start < 0 or size < 0 or start + size > self.nbytes:
            raise ValueError(f"range [{start}, {start + size}) outside a tensor of {self.nbytes} bytes")
        isz = self.itemsize
        first, end = start // isz, -(-(start + size) // isz)  # the elements the range touches
        aligned = start % isz == 0 and size % isz == 0
        dst = out[:size] if aligned and out is not None else np.empty((end - first) * isz, np.uint8)
        if end > first:
            _copy_elements(self._t, first, end, lazy_torch().from_numpy(dst).view(self._t.dtype))
        if aligned:
            return dst
        piece = dst[start - first * isz:start - first * isz + size]
        if out is None:
            return piece
        out[:size] = piece
        return out[:size]


def _copy_elements(t: Any, first: int, end: int, dst: Any) -> None:
    """Copy elements [first, end) of t in row-major order into the contiguous 1-D dst, row block by row block
    (whole rows in one copy_, the partial rows at either end recursively), never making t contiguous."""
    if end <= first:
        return
    if t.dim() <= 1:
        dst.copy_(t.reshape(-1)[first:end])  # a 1-D (or 0-D) tensor: reshape is a view
        return
    per = t[0].numel()
    r0, r1 = first // per, (end - 1) // per
    if r0 == r1:
        _copy_elements(t[r0], first - r0 * per, end - r0 * per, dst)
        return
    head = (r0 + 1) * per - first
    _copy_elements(t[r0], first - r0 * per, per, dst[:head])
    rows = r1 - r0 - 1
    if rows:
        dst[head:head + rows * per].view(rows, *t.shape[1:]).copy_(t[r0 + 1:r1])
    _copy_elements(t[r1], 0, end - r1 * per, dst[head + rows * per:])


def tensor_bytes(t: Any, baseline: DeviceBaseline | None = None,
                 name: str = "") -> np.ndarray | DeviceBytes | StridedBytes:
    """A tensor's bytes for a push: contiguous host tensors as a flat uint8 array (no copy), contiguous
    accelerator tensors as DeviceBytes (copied a chunk at a time as the push reads them; with a baseline, only
    their changed elements are), non-contiguous tensors on any device as StridedBytes (copied a chunk at a time,
    without a baseline). A DTensor is gathered with full_tensor(), a collective over its mesh, here on the calling
    thread.
    """
    t = _plain_tensor(t)
    if not t.is_contiguous():
        return StridedBytes(t)
    if t.device.type != "cpu":
        return DeviceBytes(t, baseline, name)
    return host_bytes(t)


@dataclass(frozen=True)
class HfTensor:
    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    data: np.ndarray | DeviceBytes | StridedBytes  # flat uint8 host memory, or read a range at a time

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


@dataclass(frozen=True)
class HfShard:
    """One safetensors file: its header bytes (length prefix included) and its tensors in file order."""

    name: str
    header: bytes
    tensors: tuple[HfTensor, ...]

    @property
    def size(self) -> int:
        return len(self.header) + sum(t.nbytes for t in self.tensors)

    def pieces(self) -> list[tuple[int, Piece]]:
        """(offset, bytes) of the header and of every tensor, in file order: the file without writing it."""
        out: list[tuple[int, Piece]] = [(0, memoryview(self.header))]
        pos = len(self.header)
        for t in self.tensors:
            data = t.data
            out.append((pos, data if is_range_bytes(data) else memoryview(data)))  # type: ignore[arg-type]
            pos += t.nbytes
        return out


def safetensors_header(tensors: list[HfTensor], metadata: Mapping[str, str] | None) -> bytes:
    """The 8-byte length and JSON header of a safetensors file whose data holds `tensors` in this order."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    pos = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    body = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


@dataclass(frozen=True)
class HfCheckpoint:
    """The planned files of an HF checkpoint: shards, the index (when sharded) and extra files."""

    shards: tuple[HfShard, ...]
    index: bytes | None
    extra_files: Mapping[str, bytes]

    def files(self) -> dict[str, list[tuple[int, Piece]]]:
        """Relative path → (offset, bytes) pieces, for every file of the checkpoint."""
        out: dict[str, list[tuple[int, Piece]]] = {s.name: s.pieces() for s in self.shards}
        if self.index is not None:
            out[INDEX_FILE] = [(0, memoryview(self.index))]
        for rel, data in self.extra_files.items():
            out[rel] = [(0, memoryview(bytes(data)))]
        return out


def check_tensor(name: Any, t: Any) -> str:
    """The safetensors dtype of t; UsageError if name or t cannot go into a shard."""
    import torch

    if not isinstance(name, str) or not name:
        raise UsageError(f"tensor names must be non-empty strings, got {name!r}")
    if not is_unicode(name):
        raise UsageError(f"tensor name {name!r} is not valid Unicode (a lone surrogate)")
    if name == "__metadata__":
        raise UsageError("a tensor cannot be named __metadata__, the name safetensors keeps for the file's metadata")
    if not isinstance(t, torch.Tensor):
        raise UsageError(f"{name} is not a torch.Tensor")
    if t.is_nested or t.layout != torch.strided:
        raise UsageError(f"{name} is a {'nested' if t.is_nested else str(t.layout).removeprefix('torch.')} tensor: "
                         "safetensors stores dense tensors only (push t.to_dense(), or its parts by name)")
    dtype = torch_dtype_name(t.dtype)
    if dtype is None:
        raise UsageError(f"{name} has dtype {t.dtype}, which safetensors cannot store")
    if t.is_meta:
        raise UsageError(f"{name} is on the meta device: it has no data to push (load or materialize the weights first)")
    return dtype


def collect_tensors(tensors: Mapping[str, Any], baseline: DeviceBaseline | None = None) -> list[HfTensor]:
    """Check names and dtypes and take each tensor's bytes (tensor_bytes), in the mapping's order."""
    out = [HfTensor(name, check_tensor(name, t), tuple(t.shape), tensor_bytes(t, baseline, name))
           for name, t in tensors.items()]
    names = Counter(t.name for t in out)
    if len(names) != len(out):  # a custom Mapping can yield a name twice
        twice = next(name for name, n in names.items() if n > 1)
        raise UsageError(f"tensor {twice!r} appears twice in the mapping")
    wait_for_devices({t.data.device for t in out if not isinstance(t.data, np.ndarray)} - {"cpu"})
    return out


def make_shard(name: str, tensors: list[HfTensor], metadata: Mapping[str, str] | None = None) -> HfShard:
    ordered = sorted(tensors, key=lambda t: (-_RANK.get(t.dtype, -1), t.name))
    return HfShard(name, safetensors_header(ordered, metadata), tuple(ordered))


def index_bytes(weight_map: Mapping[str, str], total_size: int) -> bytes:
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()


def plan_checkpoint(tensors: Mapping[str, Any] | list[HfTensor], *, max_shard_bytes: int | None = DEFAULT_SHARD_BYTES,
                    metadata: Mapping[str, str] | None = None,
                    extra_files: Mapping[str, bytes] | None = None,
                    device_baseline: DeviceBaseline | None = None) -> HfCheckpoint:
    """Cut the tensors (in order) into shards of at most max_shard_bytes (one file when they fit)."""
    if max_shard_bytes is not None:
        check_count(max_shard_bytes, "max_shard_bytes", 1)  # "5GB" was a TypeError, 0 and -1 one shard per tensor
    items = tensors if isinstance(tensors, list) else collect_tensors(tensors, device_baseline)
    groups: list[list[HfTensor]] = [[]]
    size = 0
    for t in items:
        if max_shard_bytes is not None and groups[-1] and size + t.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    meta = dict(metadata) if metadata is not None else {"format": "pt"}
    extra = dict(extra_files or {})
    for rel, data in extra.items():
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise UsageError(f"extra file {rel!r} must be bytes, got {type(data).__name__} (encode it: "
                             f"json.dumps(config).encode())")
    shards: tuple[HfShard, ...]
    if len(groups) == 1:
        shards = (make_shard(SINGLE_FILE, groups[0], meta),)
        index = None
    else:
        shards = tuple(make_shard(shard_file_name(i, len(groups)), g, meta) for i, g in enumerate(groups, 1))
        index = index_bytes({t.name: s.name for s in shards for t in s.tensors}, sum(t.nbytes for t in items))
    own = {s.name for s in shards} | ({INDEX_FILE} if index else set())
    clash = set(extra) & own
    if clash:
        raise UsageError(f"extra file {sorted(clash)[0]} clashes with a file of the checkpoint")
    nested = path_clash(set(extra) | own)
    if nested is not None:
        raise UsageError(f"{nested[0]} would be both a file and the directory of {nested[1]}")
    return HfCheckpoint(shards, index, extra)


def write_files(files: Mapping[str, Sequence[tuple[int, Any]]], out_dir: str) -> list[str]:
    """Write planned files under out_dir; returns their relative paths. Pieces: any buffer, or RangeBytes."""
    for rel, pieces in files.items():
        path = os.path.join(out_dir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            for _offset, data in pieces:
                if not is_range_bytes(data):
                    fh.write(data)  # bytes, a memoryview, a numpy array
                    continue
                for start in range(0, data.nbytes, _WRITE_BLOCK):
                    fh.write(memoryview(data.read(start, min(_WRITE_BLOCK, data.nbytes - start))))
    return list(files)


_WRITE_BLOCK = 64 << 20  # bytes of an accelerator tensor held on the host at a time while writing a file


def write_hf_checkpoint(tensors: Mapping[str, Any], out_dir: str, *, extra_files: Mapping[str, bytes] | None = None,
                        max_shard_bytes: int | None = DEFAULT_SHARD_BYTES,
                        metadata: Mapping[str, str] | None = None) -> list[str]:
    """Serialize name → torch tensor (any device, any layout) as HF-style safetensors shards; returns the paths."""
    plan = plan_checkpoint(tensors, max_shard_bytes=max_shard_bytes, metadata=metadata, extra_files=extra_files)
    os.makedirs(out_dir, exist_ok=True)
    return write_files(plan.files(), out_dir)


__all__ = ["DEFAULT_SHARD_BYTES", "DeviceBytes", "HfCheckpoint", "HfShard", "HfTensor", "INDEX_FILE", "check_tensor", "collect_tensors",
           "host_bytes", "index_bytes", "make_shard", "plan_checkpoint", "safetensors_header", "shard_file_name",
           "tensor_bytes", "torch_dtype_name", "wait_for_devices", "write_files", "write_hf_checkpoint"]
