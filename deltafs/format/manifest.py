"""Manifest records, canonical JSON and validation: the on-disk truth of one version. No I/O."""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from dataclasses import dataclass, field
from typing import Any

from deltafs.errors import FormatError
from deltafs.format.dtypes import DTYPE_SIZES, nbytes

FORMAT_VERSION = 1
MANIFEST_FORMAT = "deltafs.manifest"
STORE_FORMAT = "deltafs.store"
HEAD_FORMAT = "deltafs.head"

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_DIGEST = re.compile(r"^(xxh3-128:[0-9a-f]{32}|sha256:[0-9a-f]{64})$")


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8: the same record always gives the same bytes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_relpath(path: str) -> str:
    """Refuse a file name that could escape the directory it is materialized in."""
    if not isinstance(path, str) or not path:
        raise FormatError(f"invalid file path {path!r}")
    if "\\" in path or "\x00" in path or path.startswith("/") or re.match(r"^[A-Za-z]:", path):
        raise FormatError(f"unsafe file path {path!r}")
    norm = posixpath.normpath(path)
    if norm != path or norm in (".", "..") or norm.startswith("../") or "/../" in f"/{norm}/":
        raise FormatError(f"unsafe file path {path!r}")
    return path


@dataclass(frozen=True)
class ChunkRef:
    """One fixed-size piece of a segment and how its bytes are stored."""

    index: int
    size: int
    codec: dict[str, Any]
    object: str | None  # sha256 hex of the stored object; None when the codec stores nothing
    stored: int  # bytes of the stored object

    @property
    def name(self) -> str:
        return str(self.codec["name"])

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "size": self.size, "codec": self.codec, "object": self.object, "stored": self.stored}

    @classmethod
    def from_json(cls, raw: Any) -> ChunkRef:
        _require(isinstance(raw, dict), "chunk must be an object")
        codec = raw.get("codec")
        _require(isinstance(codec, dict) and isinstance(codec.get("name"), str), "chunk codec must name itself")
        obj = raw.get("object")
        _require(obj is None or (isinstance(obj, str) and bool(_HEX64.match(obj))), f"bad chunk object id {obj!r}")
        return cls(
            index=_int(raw.get("index"), "chunk index"),
            size=_int(raw.get("size"), "chunk size"),
            codec=codec,
            object=obj,
            stored=_int(raw.get("stored"), "chunk stored size"),
        )


@dataclass(frozen=True)
class Segment:
    """A byte range of a file: a safetensors header, one tensor's data, or a whole plain file."""

    key: str  # identity across versions: "t:<tensor>", "h:<path>" or "f:<path>"
    kind: str  # "tensor" | "header" | "blob"
    offset: int  # byte offset in the file
    size: int
    digest: str  # "xxh3-128:<hex>" of the segment's bytes
    chunks: tuple[ChunkRef, ...]
    dtype: str | None = None
    shape: tuple[int, ...] | None = None

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype] if self.dtype else 1

    @property
    def tensor_name(self) -> str | None:
        return self.key[2:] if self.kind == "tensor" else None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "key": self.key,
            "kind": self.kind,
            "offset": self.offset,
            "size": self.size,
            "digest": self.digest,
            "chunks": [c.to_json() for c in self.chunks],
        }
        if self.kind == "tensor":
            out["dtype"] = self.dtype
            out["shape"] = list(self.shape or ())
        return out

    @classmethod
    def from_json(cls, raw: Any) -> Segment:
        _require(isinstance(raw, dict), "segment must be an object")
        kind = raw.get("kind")
        _require(kind in ("tensor", "header", "blob"), f"unknown segment kind {kind!r}")
        key = raw.get("key")
        _require(isinstance(key, str) and key[:2] in ("t:", "h:", "f:"), f"bad segment key {key!r}")
        digest = raw.get("digest")
        _require(isinstance(digest, str) and bool(_DIGEST.match(digest)), f"bad digest {digest!r}")
        chunks = raw.get("chunks")
        _require(isinstance(chunks, list), "segment chunks must be a list")
        dtype = shape = None
        if kind == "tensor":
            dtype = raw.get("dtype")
            _require(dtype in DTYPE_SIZES, f"unknown dtype {dtype!r} for {key}")
            rshape = raw.get("shape")
            _require(isinstance(rshape, list), f"bad shape for {key}")
            shape = tuple(_int(d, "dimension") for d in rshape)
        seg = cls(
            key=key,
            kind=kind,
            offset=_int(raw.get("offset"), "segment offset"),
            size=_int(raw.get("size"), "segment size"),
            digest=digest,
            chunks=tuple(ChunkRef.from_json(c) for c in chunks),
            dtype=dtype,
            shape=shape,
        )
        if kind == "tensor":
            _require(nbytes(seg.dtype or "", seg.shape or ()) == seg.size, f"{key}: size disagrees with dtype and shape")
        return seg


@dataclass(frozen=True)
class FileEntry:
    """One file of the checkpoint directory, as an ordered list of segments that tile it."""

    path: str
    size: int
    sha256: str
    format: str  # "safetensors" | "blob"
    segments: tuple[Segment, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "size": self.size,
            "sha256": self.sha256,
            "format": self.format,
            "segments": [s.to_json() for s in self.segments],
        }

    @classmethod
    def from_json(cls, raw: Any) -> FileEntry:
        _require(isinstance(raw, dict), "file must be an object")
        fmt = raw.get("format")
        _require(fmt in ("safetensors", "blob"), f"unknown file format {fmt!r}")
        sha = raw.get("sha256")
        _require(isinstance(sha, str) and bool(_HEX64.match(sha)), f"bad sha256 {sha!r}")
        segs = raw.get("segments")
        _require(isinstance(segs, list), "file segments must be a list")
        try:
            path = check_relpath(raw.get("path"))  # type: ignore[arg-type]
        except FormatError as exc:
            raise FormatError(f"malformed manifest: {exc}") from None
        return cls(
            path=path,
            size=_int(raw.get("size"), "file size"),
            sha256=sha,
            format=fmt,
            segments=tuple(Segment.from_json(s) for s in segs),
        )


@dataclass(frozen=True)
class Manifest:
    """Everything needed to rebuild one version from its parent (delta) or from nothing (full)."""

    store_id: str
    version: int
    parent: int | None
    parent_digest: str | None
    kind: str  # "full" | "delta"
    chunk_bytes: int
    created: str
    files: tuple[FileEntry, ...]
    metadata: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    digest: str = ""  # sha256 of the canonical JSON without this field; filled by seal()

    def body(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "format_version": FORMAT_VERSION,
            "store_id": self.store_id,
            "version": self.version,
            "parent": self.parent,
            "parent_digest": self.parent_digest,
            "kind": self.kind,
            "chunk_bytes": self.chunk_bytes,
            "created": self.created,
            "metadata": self.metadata,
            "stats": self.stats,
            "files": [f.to_json() for f in self.files],
        }

    def seal(self) -> Manifest:
        """Return a copy whose digest field is the hash of its body."""
        from dataclasses import replace

        return replace(self, digest="sha256:" + sha256_hex(canonical_json(self.body())))

    def to_bytes(self) -> bytes:
        body = self.body()
        body["digest"] = self.digest
        return canonical_json(body)

    def segments(self) -> dict[str, tuple[FileEntry, Segment]]:
        return {s.key: (f, s) for f in self.files for s in f.segments}

    @property
    def raw_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str = "manifest") -> Manifest:
        try:
            raw = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise FormatError(f"{where} is not valid JSON: {exc}") from None
        try:
            man = cls._from_json(raw)
        except FormatError as exc:
            raise FormatError(f"{where}: {exc}") from None
        expected = "sha256:" + sha256_hex(canonical_json(man.body()))
        if man.digest != expected:
            raise FormatError(f"{where}: digest field does not match its contents (corrupt or edited)")
        validate(man)
        return man

    @classmethod
    def _from_json(cls, raw: Any) -> Manifest:
        _require(isinstance(raw, dict), "manifest must be a JSON object")
        _require(raw.get("format") == MANIFEST_FORMAT, f"not a deltafs manifest (format={raw.get('format')!r})")
        fv = raw.get("format_version")
        if fv != FORMAT_VERSION:
            raise FormatError(f"unknown manifest format version {fv!r} (this deltafs reads {FORMAT_VERSION})")
        kind = raw.get("kind")
        _require(kind in ("full", "delta"), f"unknown version kind {kind!r}")
        files = raw.get("files")
        _require(isinstance(files, list), "files must be a list")
        parent = raw.get("parent")
        _require(parent is None or isinstance(parent, int), "parent must be an integer or null")
        pdig = raw.get("parent_digest")
        _require(pdig is None or (isinstance(pdig, str) and bool(_DIGEST.match(pdig))), "bad parent_digest")
        for name in ("metadata", "stats"):
            _require(isinstance(raw.get(name, {}), dict), f"{name} must be an object")
        _require(isinstance(raw.get("store_id"), str), "store_id must be a string")
        _require(isinstance(raw.get("created"), str), "created must be a string")
        _require(isinstance(raw.get("digest"), str), "digest must be a string")
        return cls(
            store_id=raw["store_id"],
            version=_int(raw.get("version"), "version"),
            parent=parent,
            parent_digest=pdig,
            kind=kind,
            chunk_bytes=_int(raw.get("chunk_bytes"), "chunk_bytes"),
            created=raw["created"],
            files=tuple(FileEntry.from_json(f) for f in files),
            metadata=raw.get("metadata", {}),
            stats=raw.get("stats", {}),
            digest=raw["digest"],
        )


def validate(man: Manifest) -> None:
    """Check the invariants FORMAT.md states with MUST; raise FormatError naming the first broken one."""
    _require(man.chunk_bytes > 0 and man.chunk_bytes % 8 == 0, "chunk_bytes must be a positive multiple of 8")
    _require((man.parent is None) == (man.parent_digest is None), "parent and parent_digest go together")
    _require(man.parent is None or man.parent < man.version, "parent must be older than the version")
    if man.kind == "full":
        _require(man.parent is None or man.parent_digest is not None, "full version parent needs a digest")
    else:
        _require(man.parent is not None, "a delta needs a parent")
    paths: set[str] = set()
    keys: set[str] = set()
    for f in man.files:
        _require(f.path not in paths, f"duplicate file {f.path}")
        paths.add(f.path)
        pos = 0
        for seg in f.segments:
            _require(seg.key not in keys, f"duplicate segment {seg.key}")
            keys.add(seg.key)
            _require(seg.offset == pos, f"{f.path}: segments must tile the file ({seg.key} at {seg.offset}, expected {pos})")
            pos += seg.size
            expected_chunks = (seg.size + man.chunk_bytes - 1) // man.chunk_bytes
            _require(len(seg.chunks) == expected_chunks, f"{seg.key}: expected {expected_chunks} chunks, found {len(seg.chunks)}")
            for i, ch in enumerate(seg.chunks):
                want = min(man.chunk_bytes, seg.size - i * man.chunk_bytes)
                _require(ch.index == i and ch.size == want, f"{seg.key}: chunk {i} has the wrong index or size")
                if man.kind == "full":
                    _require(ch.name not in DELTA_CODECS, f"{seg.key}: a full version cannot reference a base")
        _require(pos == f.size, f"{f.path}: segments cover {pos} bytes of {f.size}")


# Codec names that need the base version's bytes to decode (see codec/).
DELTA_CODECS = frozenset({"same", "xor", "sparse", "dense"})


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise FormatError(f"malformed manifest: {message}")


def _int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise FormatError(f"malformed manifest: {what} must be a non-negative integer, got {value!r}")
    return value


@dataclass(frozen=True)
class StoreConfig:
    """The store's fixed identity and parameters, written once at creation (deltafs.json)."""

    store_id: str
    chunk_bytes: int
    created: str

    def to_bytes(self) -> bytes:
        return canonical_json(
            {
                "format": STORE_FORMAT,
                "format_version": FORMAT_VERSION,
                "store_id": self.store_id,
                "chunk_bytes": self.chunk_bytes,
                "created": self.created,
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> StoreConfig:
        try:
            raw = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            raise FormatError("store config deltafs.json is not valid JSON") from None
        if not isinstance(raw, dict) or raw.get("format") != STORE_FORMAT:
            raise FormatError("deltafs.json is not a deltafs store config")
        if raw.get("format_version") != FORMAT_VERSION:
            raise FormatError(f"unknown store format version {raw.get('format_version')!r} (this deltafs reads {FORMAT_VERSION})")
        cb = raw.get("chunk_bytes")
        if not isinstance(cb, int) or cb <= 0 or cb % 8:
            raise FormatError("deltafs.json: chunk_bytes must be a positive multiple of 8")
        return cls(store_id=str(raw.get("store_id")), chunk_bytes=cb, created=str(raw.get("created")))


@dataclass(frozen=True)
class Head:
    """The one mutable pointer: the newest committed version and its manifest digest."""

    version: int
    digest: str

    def to_bytes(self) -> bytes:
        return canonical_json({"format": HEAD_FORMAT, "format_version": FORMAT_VERSION, "version": self.version, "digest": self.digest})

    @classmethod
    def from_bytes(cls, data: bytes) -> Head:
        try:
            raw = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            raise FormatError("HEAD is not valid JSON") from None
        if not isinstance(raw, dict) or raw.get("format") != HEAD_FORMAT:
            raise FormatError("HEAD is not a deltafs head record")
        if raw.get("format_version") != FORMAT_VERSION:
            raise FormatError(f"unknown HEAD format version {raw.get('format_version')!r}")
        v, d = raw.get("version"), raw.get("digest")
        if not isinstance(v, int) or v < 0 or not isinstance(d, str) or not _DIGEST.match(d):
            raise FormatError("HEAD is malformed")
        return cls(version=v, digest=d)


def manifest_key(version: int) -> str:
    return f"manifests/v{version:010d}.json"


def parse_manifest_key(key: str) -> int | None:
    m = re.search(r"manifests/v(\d{10})\.json$", key)
    return int(m.group(1)) if m else None


def chunk_key(object_id: str) -> str:
    return f"chunks/{object_id[:2]}/{object_id}"
