"""Read a push source (a .safetensors file or an HF checkpoint directory) into files and segments."""

from __future__ import annotations

import bisect
import json
import logging
import math
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from deltafs.errors import FormatError, SourceError
from deltafs.format.dtypes import DTYPE_SIZES, PACKED_BITS, nbytes
from deltafs.format.manifest import check_relpath
from deltafs.format.records import is_unicode
from deltafs.publish.select import is_store_dir, refuse_unpublishable, selected

log = logging.getLogger("deltafs")

# A safetensors header larger than this is not a real checkpoint (the format's own limit is 100 MB).
MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class SourceSegment:
    key: str
    kind: str  # "header" | "tensor" | "blob"
    offset: int
    size: int
    dtype: str | None = None
    shape: tuple[int, ...] | None = None

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype] if self.dtype else 1


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative, '/'-separated
    abspath: str
    size: int
    format: str  # "safetensors" | "blob"
    segments: tuple[SourceSegment, ...]
    # In-memory files (push_tensors): (offset, bytes) pieces covering the file in order; None: read abspath.
    pieces: tuple[tuple[int, Piece], ...] | None = None

    def open(self) -> FileReader:
        return MemoryReader(self.pieces) if self.pieces is not None else DiskReader(self.abspath)


class DiskReader:
    """Positional reads of a file on disk (os.pread: no shared offset, safe from many threads)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        self.stamp = self._stamp()

    def read(self, offset: int, size: int) -> bytes | memoryview:
        return os.pread(self.fd, size, offset)

    def _stamp(self) -> tuple[int, int]:
        st = os.fstat(self.fd)
        return st.st_size, st.st_mtime_ns

    def written_since_open(self) -> bool:
        """Whether the file was written or resized since it was opened (its size or modification time moved): the
        bytes read from it may mix two versions. Not its change time, which a hard link to it (the push cache's)
        moves too."""
        return self._stamp() != self.stamp

    def close(self) -> None:
        os.close(self.fd)


class RangeBytes(Protocol):
    """Bytes that are not in host memory (an accelerator tensor's): read a range at a time, into a host copy."""

    nbytes: int

    def read(self, start: int, size: int, out: Any = None) -> Any: ...


Piece = memoryview | RangeBytes


class MemoryReader:
    """Reads of an in-memory file; a read never crosses a segment, so it is a view of one piece (no copy), or the
    host copy of that range of a RangeBytes piece."""

    def __init__(self, pieces: tuple[tuple[int, Piece], ...]) -> None:
        self.pieces = pieces
        self.starts = [off for off, _ in pieces]

    def read(self, offset: int, size: int, out: Any = None) -> Any:
        """size bytes at offset; out: a uint8 buffer of at least size bytes that a copy may go into."""
        start, data = self._piece(offset)
        if isinstance(data, memoryview):
            return data[offset - start : offset - start + size]
        return data.read(offset - start, size, out)

    def read_against(self, offset: int, size: int, out: Any, base: Any, versions: Any) -> tuple[Any, Any]:
        """read(), for a push's encode, given these bytes in its base version (base, or None) and (base version,
        version being written): a piece that can (an accelerator tensor's with a DeviceBaseline) rebuilds the
        range from base and its changes, and returns those changes as codec.encode's `known`; otherwise (the
        bytes, None)."""
        start, data = self._piece(offset)
        read_against = getattr(data, "read_against", None)
        if read_against is None:
            return self.read(offset, size, out), None
        got: tuple[Any, Any] = read_against(offset - start, size, out, base, versions)
        return got

    def copies(self, offset: int) -> bool:
        """Whether a read at offset copies (a RangeBytes piece) rather than returning a view."""
        return not isinstance(self._piece(offset)[1], memoryview)

    def _piece(self, offset: int) -> tuple[int, Piece]:
        return self.pieces[bisect.bisect_right(self.starts, offset) - 1]

    def close(self) -> None:
        pass


FileReader = DiskReader | MemoryReader


def memory_source(files: Mapping[str, Sequence[tuple[int, Any]]]) -> list[SourceFile]:
    """SourceFiles for files held in memory as (offset, bytes) pieces (see deltafs.publish.hf); a piece may
    also be RangeBytes (an accelerator tensor's), read a chunk at a time by the push."""
    out = []
    for rel in sorted(files):
        pieces = tuple((off, data if is_range_bytes(data) else memoryview(data).cast("B")) for off, data in files[rel])
        size = sum(d.nbytes for _, d in pieces)
        try:
            check_relpath(rel)
        except FormatError as exc:
            raise SourceError(f"unsupported file name {rel!r} ({exc})") from None
        if rel.endswith(".safetensors"):
            out.append(SourceFile(rel, f"<memory>/{rel}", size, "safetensors",
                                  safetensors_segments(rel, bytes(pieces[0][1]), size), pieces))
        else:
            out.append(SourceFile(rel, f"<memory>/{rel}", size, "blob", (SourceSegment(f"f:{rel}", "blob", 0, size),),
                                  pieces))
    check_unique_tensors(out)  # an extra .safetensors file repeating a pushed tensor: before any chunk is written
    return out


def is_range_bytes(data: Any) -> bool:
    """Whether a piece is RangeBytes (read a range at a time) rather than a buffer (bytes, memoryview, array)."""
    return not isinstance(data, (bytes, bytearray, memoryview)) and callable(getattr(data, "read", None))


def scan_source(src: str, *, include: Sequence[str] | None = None, exclude: Sequence[str] | None = None,
                default_excludes: bool = True) -> list[SourceFile]:
    """List the files of src with their segments; raise SourceError for anything unusable.

    Files are selected by deltafs.publish.select (default ignores plus include/exclude globs).
    """
    src = os.path.expanduser(src)
    if not os.path.exists(src):
        raise SourceError(f"source {src} does not exist")
    refuse_unpublishable(src)
    if os.path.isfile(src):
        if not src.endswith(".safetensors"):
            raise SourceError(f"{src} is not a .safetensors file or a checkpoint directory")
        return [scan_file(os.path.basename(src), src)]
    if not os.path.isdir(src):
        raise SourceError(f"{src} is neither a file nor a directory")
    files = []
    # Links are followed, to files (as a Hugging Face snapshot's are) and to directories (a shared tokenizer
    # folder) alike: the version holds what the trainer's directory shows. A directory reached a second time (a
    # link cycle, or a second link to one folder) is not walked again, with a warning.
    seen_dirs = {os.path.realpath(src)}
    for dirpath, dirnames, filenames in os.walk(src, followlinks=True):
        walk = []
        for d in sorted(dirnames):
            full = os.path.join(dirpath, d)
            real = os.path.realpath(full)
            if is_store_dir(full):
                continue
            if real in seen_dirs:
                log.warning("%s leads to a directory published already (a link cycle, or a second link to one "
                            "folder): its files are not published under this name too", full)
                continue
            seen_dirs.add(real)
            walk.append(d)
        dirnames[:] = walk
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, src).replace(os.sep, "/")
            if not selected(rel, include, exclude, default_excludes=default_excludes):
                continue
            if not os.path.isfile(full):  # dangling link, socket, fifo
                raise SourceError(f"{full} is not a regular file")
            files.append(scan_file(rel, full))
    if not files:
        raise SourceError(f"{src} holds no files to publish" + (" (after --include/--exclude)" if include or exclude else ""))
    check_unique_tensors(files)
    return files


def check_unique_tensors(files: Sequence[SourceFile]) -> None:
    """SourceError when two files hold a tensor of the same name (a version names each tensor once)."""
    seen: dict[str, str] = {}
    for f in files:
        for seg in f.segments:
            if seg.kind == "tensor":
                if seg.key in seen:
                    raise SourceError(f"tensor {seg.key[2:]} appears in both {seen[seg.key]} and {f.path}")
                seen[seg.key] = f.path


def scan_file(rel: str, full: str) -> SourceFile:
    """One file on disk as a SourceFile (safetensors split into header and tensors, anything else one blob)."""
    try:
        check_relpath(rel)
    except FormatError as exc:
        raise SourceError(f"unsupported file name {rel!r} ({exc})") from None
    try:
        size = os.path.getsize(full)
        if rel.endswith(".safetensors"):
            with open(full, "rb") as fh:
                head = fh.read(8)  # the header's length, then the header only (not the first 100 MiB of tensors)
                if len(head) == 8:
                    hlen = struct.unpack("<Q", head)[0]
                    head += fh.read(min(hlen, MAX_HEADER_BYTES, max(0, size - 8)))
                segments = safetensors_segments(rel, head, size)
            return SourceFile(rel, full, size, "safetensors", segments)
        with open(full, "rb"):
            pass  # readable?
    except PermissionError:
        raise SourceError(f"cannot read {full}: permission denied") from None
    except OSError as exc:
        raise SourceError(f"cannot read {full}: {exc.strerror or exc}") from None
    return SourceFile(rel, full, size, "blob", (SourceSegment(f"f:{rel}", "blob", 0, size),))


class _DuplicateName(ValueError):
    pass


def _unique_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's members, refusing a name given twice (json.loads keeps the last one silently)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                raise _DuplicateName(name)
            seen.add(name)
    return out


def _count(value: object) -> bool:
    """A dimension or offset as safetensors stores them: an unsigned 64-bit integer (a JSON true is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 64


def safetensors_segments(rel: str, head: bytes, size: int) -> tuple[SourceSegment, ...]:
    """Split a safetensors file into its header and one segment per tensor, in file order."""
    bad = f"{rel} is not a valid safetensors file"
    if size < 8 or len(head) < 8:
        raise SourceError(f"{bad}: too short")
    (hlen,) = struct.unpack("<Q", head[:8])
    if hlen > MAX_HEADER_BYTES or 8 + hlen > size or 8 + hlen > len(head):
        raise SourceError(f"{bad}: header length {hlen} does not fit the file")
    # Strict UTF-8 without a byte-order mark, as the safetensors loaders read it (json.loads of bytes would take a
    # BOM, UTF-16 and encoded surrogates).
    if bytes(head[8:11]) == b"\xef\xbb\xbf":
        raise SourceError(f"{bad}: the header starts with a byte-order mark")
    try:
        header = json.loads(bytes(head[8 : 8 + hlen]).decode("utf-8"), object_pairs_hook=_unique_members)
    except _DuplicateName as exc:
        raise SourceError(f"{bad}: the header names {exc.args[0]!r} twice") from None
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise SourceError(f"{bad}: header is not JSON") from None
    if not isinstance(header, dict):
        raise SourceError(f"{bad}: header is not a JSON object")
    meta = header.get("__metadata__")
    if isinstance(meta, dict) and "data_offsets" in meta:
        raise SourceError(f"{bad}: a tensor is named __metadata__, the name safetensors keeps for the file's "
                          "metadata: rename the tensor")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) and is_unicode(k + v)
                                                                 for k, v in meta.items())):
        raise SourceError(f"{bad}: __metadata__ must map names to strings (the safetensors loaders refuse "
                          "anything else)")
    data_start = 8 + hlen
    tensors = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise SourceError(f"{bad}: entry {name!r} lacks dtype, shape or data_offsets") from None
        if not is_unicode(name):
            raise SourceError(f"{bad}: a tensor name is not valid Unicode (a lone surrogate): {name!r}")
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise SourceError(f"{rel}: tensor {name} has dtype {dtype!r}, which deltafs does not know")
        if not (isinstance(shape, list) and all(_count(d) for d in shape)):
            raise SourceError(f"{bad}: tensor {name} has a bad shape")
        if not (_count(begin) and _count(end) and begin <= end):
            raise SourceError(f"{bad}: tensor {name} has bad data offsets")
        if dtype in PACKED_BITS and math.prod(shape) * PACKED_BITS[dtype] % 8:
            raise SourceError(f"{bad}: tensor {name} has {math.prod(shape)} {dtype} elements, which do not fill whole "
                              "bytes (the safetensors loaders refuse it)")
        if end - begin != nbytes(dtype, shape):
            raise SourceError(f"{bad}: tensor {name} occupies {end - begin} bytes, its dtype and shape need {nbytes(dtype, shape)}")
        tensors.append((begin, end, name, dtype, tuple(shape)))
    tensors.sort()
    pos = 0
    segments = [SourceSegment(f"h:{rel}", "header", 0, data_start)]
    for begin, end, name, dtype, shape in tensors:
        if begin != pos:
            raise SourceError(f"{bad}: tensor data has a hole or overlap at {name}")
        segments.append(SourceSegment(f"t:{name}", "tensor", data_start + begin, end - begin, dtype, shape))
        pos = end
    if data_start + pos != size:
        raise SourceError(f"{bad}: file is {size} bytes, header accounts for {data_start + pos} (truncated or padded)")
    return tuple(segments)
