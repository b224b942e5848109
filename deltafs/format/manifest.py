"""Manifest records, canonical JSON and validation: the on-disk truth of one version. No I/O."""

from __future__ import annotations

import functools
import hashlib
import json
import posixpath
import re
import threading
from dataclasses import dataclass, field, replace
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

import zstandard

from deltafs.errors import FormatError
from deltafs.format.dtypes import DTYPE_SIZES, nbytes
from deltafs.format.keys import chunk_key, is_valid_version, manifest_key, parse_manifest_key
from deltafs.format.versions import MAX_VERSION, MIN_VERSION
from deltafs.format.records import (
    HEAD_FORMAT,
    MANIFEST_MAX_BYTES,
    STORE_FORMAT,
    Head,
    StoreConfig,
    canonical_json,
    check_readable,
    is_manifest_digest,
    load_json,
)

# Manifests this release writes; it reads every version in READ_FORMAT_VERSIONS.
FORMAT_VERSION = 3
READ_FORMAT_VERSIONS = (1, 2, 3)
MANIFEST_FORMAT = "deltafs.manifest"
# A v2 or v3 manifest is stored as one zstd frame of its canonical JSON; a v1 manifest is the JSON itself.
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
MANIFEST_ZSTD_LEVEL = 1

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_TREE_DIGEST = re.compile(r"^xxh3-tree:[0-9a-f]{32}$")
_SEGMENT_DIGEST = {1: re.compile(r"^xxh3-128:[0-9a-f]{32}$"), 2: _TREE_DIGEST, 3: _TREE_DIGEST}
_FILE_DIGEST = {1: re.compile(r"^sha256:[0-9a-f]{64}$"), 2: _TREE_DIGEST, 3: _TREE_DIGEST}


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
    try:
        encoded = path.encode("utf-8")  # a lone surrogate (a name that was not UTF-8) cannot be stored or created
    except UnicodeEncodeError:
        raise FormatError(f"file path {path!r} is not valid Unicode (not UTF-8 on disk)") from None
    if len(encoded) >= PATH_MAX:
        raise FormatError(f"file path {path[:60]!r}... is {len(encoded)} bytes, longer than the {PATH_MAX - 1} a "
                          "file system path allows")
    return path


def path_clash(paths: Iterable[str]) -> tuple[str, str] | None:
    """(a, b) where a is one of paths and also a directory of b (another of them): such files cannot coexist in
    one directory tree. None when they can."""
    names = set(paths)
    for path in sorted(names):
        parts = path.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in names:
                return "/".join(parts[:i]), path
    return None


PATH_MAX = 4096  # Linux's limit on a path, its terminating NUL included; DEST's own path comes on top


@dataclass(frozen=True)
class ChunkRef:
    """One fixed-size piece of a segment and how its bytes are stored.

    From format 3 the payloads of several small chunks may share one stored object (a pack): `pack` is then
    (offset of this chunk's payload in the object, the object's size), and `stored` is the payload's size.
    """

    index: int
    size: int
    codec: dict[str, Any]
    object: str | None  # sha256 hex of the stored object; None when the codec stores nothing
    stored: int  # bytes of this chunk's payload (the whole object unless packed)
    pack: tuple[int, int] | None = None  # (offset in the object, object size) of a packed payload

    @property
    def name(self) -> str:
        return str(self.codec["name"])

    @property
    def object_bytes(self) -> int:
        """Size of the stored object that holds the payload."""
        return self.pack[1] if self.pack is not None else self.stored

    def payload_of(self, data: bytes) -> bytes:
        """This chunk's payload within its object's bytes (the bytes themselves unless packed)."""
        if self.pack is None:
            return data
        return data[self.pack[0]:self.pack[0] + self.stored]

    def to_json(self, format_version: int = FORMAT_VERSION) -> dict[str, Any]:
        out = {"index": self.index, "size": self.size, "codec": self.codec, "object": self.object, "stored": self.stored}
        if format_version >= 3:
            out["pack"] = list(self.pack) if self.pack is not None else None
        elif self.pack is not None:
            raise FormatError(f"a format {format_version} manifest cannot hold packed chunks")
        return out

    @classmethod
    def from_json(cls, raw: Any, format_version: int = FORMAT_VERSION) -> ChunkRef:
        keys = _CHUNK_KEYS_V3 if format_version >= 3 else _CHUNK_KEYS
        if type(raw) is dict and raw.keys() == keys:
            # The usual, valid record in a few C-level checks (a 70B model's manifest holds ~35,000 of these); anything
            # else takes the field-by-field path below, which says what is wrong.
            index, size, codec, obj, stored = raw["index"], raw["size"], raw["codec"], raw["object"], raw["stored"]
            pack = raw.get("pack")
            if (type(index) is int and type(size) is int and type(stored) is int and min(index, size, stored) >= 0
                    and type(codec) is dict and type(codec.get("name")) is str
                    and (obj is None or (type(obj) is str and _HEX64.match(obj) is not None))
                    and (pack is None or (type(pack) is list and len(pack) == 2 and type(pack[0]) is int
                                          and type(pack[1]) is int and obj is not None
                                          and 0 <= pack[0] and pack[0] + stored <= pack[1]))):
                return cls(index, size, codec, obj, stored, None if pack is None else (pack[0], pack[1]))
        _require(isinstance(raw, dict), "chunk must be an object")
        _exact_members(raw, keys, "chunk")
        codec = raw.get("codec")
        _require(isinstance(codec, dict) and isinstance(codec.get("name"), str), "chunk codec must name itself")
        obj = raw.get("object")
        _require(obj is None or (isinstance(obj, str) and bool(_HEX64.match(obj))), f"bad chunk object id {obj!r}")
        stored = _int(raw.get("stored"), "chunk stored size")
        rpack = raw.get("pack")
        pack = None
        if rpack is not None:
            _require(isinstance(rpack, list) and len(rpack) == 2, f"chunk pack must be [offset, object size], got {rpack!r}")
            pack = (_int(rpack[0], "chunk pack offset"), _int(rpack[1], "chunk pack object size"))
            _require(obj is not None, "a packed chunk must name its object")
            _require(pack[0] + stored <= pack[1], f"chunk payload [{pack[0]}, +{stored}) lies outside its object of "
                                                  f"{pack[1]} bytes")
        return cls(
            index=_int(raw.get("index"), "chunk index"),
            size=_int(raw.get("size"), "chunk size"),
            codec=codec,
            object=obj,
            stored=stored,
            pack=pack,
        )


def payload_bytes(chunks: Iterable[ChunkRef]) -> int:
    """Bytes of the distinct payloads the records name: a payload that several records share (identical chunks,
    stored once in a pack or as one content-addressed object) counts once."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for c in chunks:
        if c.object is None:
            continue
        key = (c.object, c.pack[0] if c.pack is not None else 0)
        if key not in seen:
            seen.add(key)
            total += c.stored
    return total


def referenced_objects(files: Iterable[FileEntry]) -> set[str]:
    """The objects the chunk records of these files name (what gc keeps, what a reader of them fetches)."""
    return {ch.object for f in files for seg in f.segments for ch in seg.chunks if ch.object is not None}


def referenced_bytes(files: Iterable[FileEntry]) -> int:
    """Bytes of the distinct objects the chunk records name: what a reader of this version fetches, whoever stored
    them (a push that reuses the objects of a killed attempt stores few bytes itself)."""
    sizes = {ch.object: ch.object_bytes for f in files for seg in f.segments for ch in seg.chunks
             if ch.object is not None}
    return sum(sizes.values())


@dataclass(frozen=True)
class Segment:
    """A byte range of a file: a safetensors header, one tensor's data, or a whole plain file."""

    key: str  # identity across versions: "t:<tensor>", "h:<path>" or "f:<path>"
    kind: str  # "tensor" | "header" | "blob"
    offset: int  # byte offset in the file
    size: int
    digest: str  # v2: "xxh3-tree:<hex>" (deltafs.format.digests); v1: "xxh3-128:<hex>" of the bytes
    chunks: tuple[ChunkRef, ...]
    dtype: str | None = None
    shape: tuple[int, ...] | None = None

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype] if self.dtype else 1

    @property
    def tensor_name(self) -> str | None:
        return self.key[2:] if self.kind == "tensor" else None

    def to_json(self, format_version: int = FORMAT_VERSION) -> dict[str, Any]:
        out: dict[str, Any] = {
            "key": self.key,
            "kind": self.kind,
            "offset": self.offset,
            "size": self.size,
            "digest": self.digest,
            "chunks": [c.to_json(format_version) for c in self.chunks],
        }
        if self.kind == "tensor":
            out["dtype"] = self.dtype
            out["shape"] = list(self.shape or ())
        return out

    @classmethod
    def from_json(cls, raw: Any, format_version: int = FORMAT_VERSION) -> Segment:
        fast = cls._from_valid_json(raw, format_version)
        if fast is not None:
            return fast
        # Anything else, field by field, saying what is wrong.
        _require(isinstance(raw, dict), "segment must be an object")
        kind = raw.get("kind")
        _require(kind in ("tensor", "header", "blob"), f"unknown segment kind {kind!r}")
        _exact_members(raw, _TENSOR_KEYS if kind == "tensor" else _SEGMENT_KEYS, f"{kind} segment")
        key = raw.get("key")
        _require(isinstance(key, str) and key[:2] in ("t:", "h:", "f:"), f"bad segment key {key!r}")
        digest = raw.get("digest")
        _require(isinstance(digest, str) and bool(_SEGMENT_DIGEST[format_version].match(digest)),
                 f"bad segment digest {digest!r}")
        chunks = raw.get("chunks")
        _require(isinstance(chunks, list), "segment chunks must be a list")
        dtype = shape = None
        if kind == "tensor":
            dtype = raw.get("dtype")
            _require(isinstance(dtype, str) and dtype in DTYPE_SIZES, f"unknown dtype {dtype!r} for {key}")
            rshape = raw.get("shape")
            _require(isinstance(rshape, list), f"bad shape for {key}")
            shape = tuple(_int(d, "dimension") for d in rshape)
        seg = cls(
            key=key,
            kind=kind,
            offset=_int(raw.get("offset"), "segment offset"),
            size=_int(raw.get("size"), "segment size"),
            digest=digest,
            chunks=tuple(ChunkRef.from_json(c, format_version) for c in chunks),
            dtype=dtype,
            shape=shape,
        )
        if kind == "tensor":
            _require(nbytes(seg.dtype or "", seg.shape or ()) == seg.size, f"{key}: size disagrees with dtype and shape")
        return seg

    @classmethod
    def _from_valid_json(cls, raw: Any, format_version: int) -> Segment | None:
        """The usual, valid record, checked in a few C-level tests and no message formatting (a 70B model's manifest
        holds ~35,000 segments); None for anything else, which from_json then checks field by field."""
        if type(raw) is not dict:
            return None
        kind = raw.get("kind")
        if not ((kind == "tensor" and raw.keys() == _TENSOR_KEYS)
                or (kind in ("header", "blob") and raw.keys() == _SEGMENT_KEYS)):
            return None
        key, offset, size, digest, chunks = raw["key"], raw["offset"], raw["size"], raw["digest"], raw["chunks"]
        if not (type(key) is str and key[:2] in ("t:", "h:", "f:") and type(offset) is int and type(size) is int
                and offset >= 0 and size >= 0 and type(digest) is str and type(chunks) is list
                and _SEGMENT_DIGEST[format_version].match(digest) is not None):
            return None
        dtype = shape = None
        if kind == "tensor":
            dtype, rshape = raw["dtype"], raw["shape"]
            if not (type(dtype) is str and dtype in DTYPE_SIZES and type(rshape) is list
                    and all(type(d) is int and d >= 0 for d in rshape)):
                return None
            shape = tuple(rshape)
            if nbytes(dtype, shape) != size:
                return None
        return cls(key, kind, offset, size, digest, tuple(ChunkRef.from_json(c, format_version) for c in chunks),
                   dtype, shape)


@dataclass(frozen=True)
class FileEntry:
    """One file of the checkpoint directory, as an ordered list of segments that tile it."""

    path: str
    size: int
    digest: str  # v2: "xxh3-tree:<hex>" over the segment digests; v1: "sha256:<hex>" of the whole file
    format: str  # "safetensors" | "blob"
    segments: tuple[Segment, ...]

    def to_json(self, format_version: int = FORMAT_VERSION) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "size": self.size, "format": self.format,
                               "segments": [s.to_json(format_version) for s in self.segments]}
        if format_version == 1:
            out["sha256"] = self.digest.removeprefix("sha256:")
        else:
            out["digest"] = self.digest
        return out

    @classmethod
    def from_json(cls, raw: Any, format_version: int = FORMAT_VERSION) -> FileEntry:
        _require(isinstance(raw, dict), "file must be an object")
        _exact_members(raw, _FILE_KEYS[1 if format_version == 1 else 2], "file")
        fmt = raw.get("format")
        _require(fmt in ("safetensors", "blob"), f"unknown file format {fmt!r}")
        if format_version == 1:
            sha = raw.get("sha256")
            _require(isinstance(sha, str) and bool(_HEX64.match(sha)), f"bad sha256 {sha!r}")
            digest = f"sha256:{sha}"
        else:
            digest = raw.get("digest")
        _require(isinstance(digest, str) and bool(_FILE_DIGEST[format_version].match(digest)), f"bad file digest {digest!r}")
        segs = raw.get("segments")
        _require(isinstance(segs, list), "file segments must be a list")
        try:
            path = check_relpath(raw.get("path"))
        except FormatError as exc:
            raise FormatError(f"malformed manifest: {exc}") from None
        return cls(
            path=path,
            size=_int(raw.get("size"), "file size"),
            digest=digest,
            format=fmt,
            segments=tuple(Segment.from_json(s, format_version) for s in segs),
        )


# Manifests this process has parsed and checked, newest last (Manifest.from_bytes, Manifest.known). Small:
# a push or pull handles one or two manifests at a time, and a large model's takes tens of MB in memory.
_CHECKED: list[Manifest] = []
_CHECKED_LOCK = threading.Lock()
_CHECKED_SIZE = 4


def _remember(man: Manifest) -> Manifest:
    with _CHECKED_LOCK:
        _CHECKED[:] = [m for m in _CHECKED if m.digest != man.digest][-(_CHECKED_SIZE - 1):] + [man]
    return man


def _known(match: Callable[[Manifest], bool]) -> Manifest | None:
    with _CHECKED_LOCK:
        candidates = list(_CHECKED)
    return next((man for man in reversed(candidates) if match(man)), None)


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
    format_version: int = FORMAT_VERSION  # 1 only for manifests read from a v1 store

    def body(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "format_version": self.format_version,
            "store_id": self.store_id,
            "version": self.version,
            "parent": self.parent,
            "parent_digest": self.parent_digest,
            "kind": self.kind,
            "chunk_bytes": self.chunk_bytes,
            "created": self.created,
            "metadata": self.metadata,
            "stats": self.stats,
            "files": [f.to_json(self.format_version) for f in self.files],
        }

    def count(self, name: str, default: int = 0) -> int:
        """stats[name] where it is a non-negative integer below 2**63, else `default`: stats are informative
        (FORMAT.md), so a missing or odd value (another writer's null, a string, a number no store could hold) reads
        as absent instead of failing `log` or a push."""
        value = self.stats.get(name)
        return value if type(value) is int and 0 <= value < 1 << 63 else default

    def seal(self) -> Manifest:
        """Return a copy whose digest field is the hash of its body."""
        return replace(self, digest="sha256:" + sha256_hex(canonical_json(self.body())))

    def sealed(self) -> Manifest:
        """seal() then checked(), with one encode of the canonical JSON instead of two (~0.3 s for a 70B model).

        The body's canonical JSON gives the digest; inserting the digest member before "files" (the key after
        "created", which follows "chunk_bytes", a number: FORMAT.md, "Manifest") makes it the whole manifest's,
        which is then checked like a parsed one and kept as to_bytes(). Nothing can change the fields in between:
        the copy is new and only this call holds it.
        """
        body = canonical_json(self.body())
        man = replace(self, digest="sha256:" + sha256_hex(body))
        at = body.index(b',"files":')
        return man._checked_as(body[:at] + man._digest_member() + body[at:])

    def to_bytes(self) -> bytes:
        """The canonical JSON (what the digest covers and what a DEST state record embeds)."""
        return self._canonical

    @functools.cached_property
    def _canonical(self) -> bytes:
        # Computed once per object: a push commits, broadcasts and installs the same manifest, and a 70B model's
        # has ~35,000 chunk records (~10 us each to encode).
        return self._encode_canonical()

    def _encode_canonical(self) -> bytes:
        body = self.body()
        body["digest"] = self.digest
        return canonical_json(body)

    def encode(self) -> bytes:
        """The bytes stored under manifests/ (and folds/): a zstd frame of the canonical JSON from v2 on."""
        data = self.to_bytes()
        return data if self.format_version == 1 else stored_manifest(data)

    def segments(self) -> dict[str, tuple[FileEntry, Segment]]:
        return {s.key: (f, s) for f in self.files for s in f.segments}

    @property
    def raw_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @classmethod
    def decode(cls, data: bytes, *, where: str = "manifest") -> Manifest:
        """A manifest from its stored bytes (v2 zstd frame or v1 JSON), decoded within MANIFEST_MAX_BYTES."""
        if len(data) > MANIFEST_MAX_BYTES:
            raise FormatError(f"{where} is {len(data)} bytes, more than the {MANIFEST_MAX_BYTES} a valid one can be")
        if data[:4] == ZSTD_MAGIC:
            try:
                data = _unzstd(data, where)
            except zstandard.ZstdError as exc:
                raise FormatError(f"{where} is a damaged zstd frame: {exc}") from None
            man = cls.from_bytes(data, where=where)
            _require(man.format_version >= 2, "a v1 manifest is never compressed")
            return man
        man = cls.from_bytes(data, where=where)
        if man.format_version >= 2:
            raise FormatError(f"{where}: a v{man.format_version} manifest must be stored compressed")
        return man

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str = "manifest") -> Manifest:
        """A manifest from its canonical JSON; the digest field must match the contents.

        Bytes identical to those of a manifest this process has already checked give that object back: a push or
        pull meets the same manifest several times (the store's copy, the broadcast to ranks), and checking one
        costs ~15-25 us per chunk record, ~0.5-1 s for a 70B model's ~35,000.
        """
        known = cls.known(data)
        if known is not None:
            return known
        return cls.from_parsed(load_json(data, where, max_bytes=MANIFEST_MAX_BYTES), where=where, text=bytes(data))

    @classmethod
    def known(cls, text: bytes) -> Manifest | None:
        """The manifest this process has checked whose canonical JSON is exactly text, else None (parse it then)."""
        return _known(lambda man: man.to_bytes() == text)

    @classmethod
    def from_parsed(cls, raw: Any, *, where: str = "manifest", text: bytes | None = None) -> Manifest:
        """A manifest from JSON already parsed within the limits (load_json), e.g. the one a DEST state embeds;
        text: the JSON it was parsed from, when the caller has it (its digest is then checked without encoding)."""
        return _remember(cls._check_parsed(raw, where, text))

    def checked(self) -> Manifest:
        """This manifest, built by this process (a push's), after the checks a parsed one gets: its digest is its
        body's and it keeps every invariant (validate); remembered, so its bytes read back are not parsed again."""
        # The canonical JSON is encoded here once, fresh from the fields (never an earlier to_bytes()), and serves
        # both the digest check and every later to_bytes() (commit, broadcast, install): one encode instead of two.
        return self._checked_as(self._encode_canonical())

    def _checked_as(self, text: bytes) -> Manifest:
        """checked(), given the canonical JSON of this manifest's fields, which becomes its to_bytes(); also by the
        limits a reader applies to the text (size, density, nesting)."""
        check_readable(text, f"manifest of version {self.version}", max_bytes=MANIFEST_MAX_BYTES)
        self.__dict__["_canonical"] = text
        return _remember(self._verified(f"manifest of version {self.version}", self._text_hash_matches(text)))

    def _digest_member(self) -> bytes:
        """',"digest":"…"' as the canonical JSON writes it (sorted between "created" and "files")."""
        return b',"digest":' + json.dumps(self.digest, ensure_ascii=False).encode()

    @classmethod
    def _check_parsed(cls, raw: Any, where: str, text: bytes | None = None) -> Manifest:
        """A manifest from parsed JSON, checked; text: the JSON it was parsed from, when there is one."""
        try:
            man = cls._from_json(raw)
        except FormatError as exc:
            raise FormatError(f"{where}: {exc}") from None
        matched = text is not None and man._text_hash_matches(text)
        man = man._verified(where, matched)
        if matched:
            man.__dict__["_canonical"] = text  # what to_bytes() would encode again (install embeds it)
        return man

    def _text_hash_matches(self, text: bytes) -> bool:
        """Whether text, without its top-level digest member, hashes to the digest field.

        For the JSON a writer produced (canonical: sorted keys, no whitespace) that text is exactly the canonical
        JSON of the body, so the check needs no encoding: about a third of what checking a manifest costs
        (~10 us per chunk record, ~0.5 s for a 70B model's 35,000). The keys before "digest" are "chunk_bytes"
        (a number) and "created" (a string, which cannot hold an unescaped quote), so the first ',"digest":'
        is the member itself. Text written any other way fails here and is checked by encoding instead.
        """
        member = self._digest_member() + b","
        at = text.find(member)
        if at < 0:
            return False
        view = memoryview(text)
        h = hashlib.sha256(view[:at + 1])
        h.update(view[at + len(member):])
        return "sha256:" + h.hexdigest() == self.digest

    def _verified(self, where: str, text_matched: bool = False) -> Manifest:
        """self, if its digest field is the hash of its body and it keeps every invariant; else FormatError.

        text_matched: the digest was already found to be the hash of the body's canonical JSON taken from a text
        of the whole manifest (_text_hash_matches); otherwise the body is encoded here and hashed."""
        if not text_matched and self.digest != "sha256:" + sha256_hex(canonical_json(self.body())):
            raise FormatError(f"{where}: digest field does not match its contents (corrupt or edited)")
        try:
            validate(self)
        except FormatError as exc:
            raise FormatError(f"{where}: {exc}") from None
        return self

    @classmethod
    def _from_json(cls, raw: Any) -> Manifest:
        _require(isinstance(raw, dict), "manifest must be a JSON object")
        _require(raw.get("format") == MANIFEST_FORMAT, f"not a deltafs manifest (format={raw.get('format')!r})")
        # Exactly the members body() writes, as the JSON Schema says: another would be outside the digest, and a
        # missing one (read as a default) would make the stored text differ from the canonical JSON it stands for.
        _exact_members(raw, _TOP_LEVEL, "top-level")
        fv = raw.get("format_version")
        if fv not in READ_FORMAT_VERSIONS or isinstance(fv, bool):
            raise FormatError(f"unknown manifest format version {fv!r} (this deltafs reads "
                              f"{', '.join(map(str, READ_FORMAT_VERSIONS))})")
        kind = raw.get("kind")
        _require(kind in ("full", "delta"), f"unknown version kind {kind!r}")
        files = raw.get("files")
        _require(isinstance(files, list), "files must be a list")
        _require(is_valid_version(raw.get("version")), f"version must be an integer from {MIN_VERSION} to {MAX_VERSION}, got {raw.get('version')!r}")
        parent = raw.get("parent")
        _require(parent is None or is_valid_version(parent), "parent must be a version number or null")
        pdig = raw.get("parent_digest")
        _require(pdig is None or is_manifest_digest(pdig), "bad parent_digest")
        for name in ("metadata", "stats"):
            _require(isinstance(raw[name], dict), f"{name} must be an object")
        _require(isinstance(raw.get("store_id"), str), "store_id must be a string")
        _require(isinstance(raw.get("created"), str), "created must be a string")
        _require(isinstance(raw.get("digest"), str), "digest must be a string")
        return cls(
            store_id=raw["store_id"],
            version=raw["version"],
            parent=parent,
            parent_digest=pdig,
            kind=kind,
            chunk_bytes=_int(raw.get("chunk_bytes"), "chunk_bytes"),
            created=raw["created"],
            files=tuple(FileEntry.from_json(f, fv) for f in files),
            metadata=raw["metadata"],
            stats=raw["stats"],
            digest=raw["digest"],
            format_version=fv,
        )


_TOP_LEVEL = frozenset(("format", "format_version", "store_id", "version", "parent", "parent_digest", "kind",
                        "chunk_bytes", "created", "metadata", "stats", "files", "digest"))


def manifest_json(stored: bytes, where: str = "manifest") -> bytes:
    """The JSON text of a stored manifest (a v2 zstd frame is decompressed; v1 bytes are returned as they are)."""
    return _unzstd(stored, where) if stored[:4] == ZSTD_MAGIC else stored


def stored_manifest(json_bytes: bytes) -> bytes:
    """What a v2 writer stores for a manifest's JSON text (a zstd frame); tools and tests that edit one use it."""
    return zstandard.ZstdCompressor(level=MANIFEST_ZSTD_LEVEL, write_content_size=True).compress(json_bytes)


def _unzstd(data: bytes, where: str) -> bytes:
    """Decompress one frame, refusing more than MANIFEST_MAX_BYTES of output without allocating it first."""
    parts, total = [], 0
    reader = zstandard.ZstdDecompressor().stream_reader(data)
    while True:
        block = reader.read(1 << 20)
        if not block:
            break
        total += len(block)
        if total > MANIFEST_MAX_BYTES:
            raise FormatError(f"{where} decompresses to more than {MANIFEST_MAX_BYTES} bytes")
        parts.append(block)
    # A frame cut short decodes to what it has and then ends quietly: the header's content size (which deltafs's
    # writers record) tells, and a clear word beats "not valid JSON" about the part that came through.
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError:
        declared = -1
    if declared >= 0 and total != declared:
        raise FormatError(f"{where} is cut short or damaged: its compressed frame gave {total} of the {declared} "
                          "bytes it declares")
    return b"".join(parts)


def validate(man: Manifest) -> None:
    """Check the invariants FORMAT.md states with MUST; raise FormatError naming the first broken one."""
    _require(is_valid_version(man.version), f"version {man.version!r} is outside {MIN_VERSION}..{MAX_VERSION}")
    _require(man.chunk_bytes > 0 and man.chunk_bytes % 8 == 0, "chunk_bytes must be a positive multiple of 8")
    _require((man.parent is None) == (man.parent_digest is None), "parent and parent_digest go together")
    _require(man.parent is None or man.parent < man.version, "parent must be older than the version")
    if man.kind == "full":
        _require(man.parent is None or man.parent_digest is not None, "full version parent needs a digest")
    else:
        _require(man.parent is not None, "a delta needs a parent")
    paths: set[str] = set()
    keys: set[str] = set()
    sizes: dict[str, int] = {}  # object -> its size, as every chunk record that names it must say
    for f in man.files:
        _require(f.path not in paths, f"duplicate file {f.path}")
        paths.add(f.path)
        pos = 0
        # Plain `if`s, not _require: this loop runs once per chunk record, and an f-string argument would be
        # formatted every time.
        for seg in f.segments:
            if seg.key in keys:
                _fail(f"duplicate segment {seg.key}")
            keys.add(seg.key)
            if seg.offset != pos:
                _fail(f"{f.path}: segments must tile the file ({seg.key} at {seg.offset}, expected {pos})")
            pos += seg.size
            expected_chunks = (seg.size + man.chunk_bytes - 1) // man.chunk_bytes
            if len(seg.chunks) != expected_chunks:
                _fail(f"{seg.key}: expected {expected_chunks} chunks, found {len(seg.chunks)}")
            for i, ch in enumerate(seg.chunks):
                if ch.index != i or ch.size != min(man.chunk_bytes, seg.size - i * man.chunk_bytes):
                    _fail(f"{seg.key}: chunk {i} has the wrong index or size")
                if man.kind == "full" and ch.name in DELTA_CODECS:
                    _fail(f"{seg.key}: a full version cannot reference a base")
                if ch.object is not None:
                    if ch.object_bytes > man.chunk_bytes + OBJECT_SLACK:
                        _fail(f"{seg.key}: chunk {i} names an object of {ch.object_bytes} bytes, more than a chunk "
                              f"grid of {man.chunk_bytes} bytes can produce")
                    if sizes.setdefault(ch.object, ch.object_bytes) != ch.object_bytes:
                        _fail(f"{seg.key}: chunk {i} gives object {ch.object} another size than an earlier record")
        _require(pos == f.size, f"{f.path}: segments cover {pos} bytes of {f.size}")


# A stored object is at most one chunk's payload, or a pack of payloads whose chunks add up to at most chunk_bytes;
# a payload exceeds its chunk by a few dozen bytes at most (stream lengths, the trailer). Readers refuse larger
# claims before fetching anything, so a hostile manifest cannot make them allocate more.
OBJECT_SLACK = 1 << 20

# Codec names that need the base version's bytes to decode: the codecs whose `needs_base` is true
# (format/ imports nothing of codec/; tests/format checks the two agree).
DELTA_CODECS = frozenset({"same", "xor", "sparse", "dense", "gamma"})


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise FormatError(f"malformed manifest: {message}")


def _fail(message: str) -> NoReturn:
    """Raise FormatError for a broken invariant (where a _require call would format its message every time)."""
    raise FormatError(f"malformed manifest: {message}")


# The members of each record (manifests/manifest.schema.json), all required: to_json writes exactly these, so another
# would be outside the digest, and a missing one read as a default would not be what the digest covers.
_CHUNK_KEYS = frozenset(("index", "size", "codec", "object", "stored"))
_CHUNK_KEYS_V3 = _CHUNK_KEYS | {"pack"}
_SEGMENT_KEYS = frozenset(("key", "kind", "offset", "size", "digest", "chunks"))
_TENSOR_KEYS = _SEGMENT_KEYS | {"dtype", "shape"}
_FILE_KEYS = {1: frozenset(("path", "size", "sha256", "format", "segments")),
              2: frozenset(("path", "size", "digest", "format", "segments"))}
_FILE_KEYS[3] = _FILE_KEYS[2]


def _exact_members(raw: dict[str, Any], members: frozenset[str], what: str) -> None:
    if raw.keys() == members:
        return
    extra, missing = raw.keys() - members, members - raw.keys()
    _require(not extra, f"unknown {what} member(s) {', '.join(sorted(map(repr, extra)))}")
    _require(not missing, f"{what} record lacks {', '.join(sorted(map(repr, missing)))}")


def _int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise FormatError(f"malformed manifest: {what} must be a non-negative integer, got {value!r}")
    return value


__all__ = [
    "DELTA_CODECS", "FORMAT_VERSION", "HEAD_FORMAT", "MANIFEST_FORMAT", "READ_FORMAT_VERSIONS", "STORE_FORMAT",
    "ChunkRef", "FileEntry", "Head", "Manifest", "Segment", "StoreConfig", "canonical_json", "check_relpath", "chunk_key",
    "is_manifest_digest", "manifest_json", "manifest_key", "path_clash", "payload_bytes", "referenced_bytes", "referenced_objects", "stored_manifest", "parse_manifest_key", "sha256_hex", "validate",
]
