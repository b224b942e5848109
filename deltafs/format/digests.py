"""Content digests of format v2: per-chunk hashes combined into segment and file digests. No I/O.

A v1 manifest hashed each segment (xxh3-128) and each file (SHA-256) as one serial stream, so a
writer or reader had to see a file's bytes in order. In v2 every chunk (a `chunk_bytes` piece of a
segment, the same pieces the manifest lists) is hashed on its own, on any thread, in any order;
a segment's digest is the hash of its chunk digests and a file's digest the hash of its segment
digests. Both are a two-level hash list, so they cost one pass over the bytes, split across cores.

Digests detect damage and bugs (a bit flip in DEST, a wrong base, a decoder fault). Authenticity
of what a store serves rests on the SHA-256 object ids and the manifest's SHA-256 digest.

Writers (publish) call:
    chunk_digest(raw_chunk_bytes)                  -> bytes   one per chunk, any thread, any order
    segment_digest(chunk_digests_in_order, size)   -> "xxh3-tree:<32 hex>"
    file_digest(segment_digests_in_order, size)    -> "xxh3-tree:<32 hex>"
or, for bytes already in one buffer, buffer_digest(data, chunk_bytes).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

# A segment's or file's digest in a format v2 manifest.
TREE_PREFIX = "xxh3-tree:"
# v1: xxh3-128 of a segment's bytes as one stream; files carried a bare SHA-256 hex.
V1_SEGMENT_PREFIX = "xxh3-128:"

CHUNK_DIGEST_SIZE = 16
_SEGMENT_DOMAIN = b"deltafs.segment.v2\x00"
_FILE_DOMAIN = b"deltafs.file.v2\x00"

Buffer = bytes | bytearray | memoryview


def chunk_digest(data: Buffer) -> bytes:
    """The 16-byte xxh3-128 of one chunk's raw (decoded) bytes."""
    return xxhash.xxh3_128_digest(data)


def segment_digest(chunk_digests: Sequence[bytes], size: int) -> str:
    """A segment's v2 digest from its chunks' digests in index order and its size in bytes.

    An empty segment (size 0) has no chunks and a well-defined digest.
    """
    return TREE_PREFIX + _combine(_SEGMENT_DOMAIN, chunk_digests, size)


def file_digest(segment_digests: Sequence[str], size: int) -> str:
    """A file's v2 digest from its segments' v2 digests in file order and its size in bytes."""
    raw = []
    for d in segment_digests:
        if not d.startswith(TREE_PREFIX):
            raise ValueError(f"not a v2 segment digest: {d!r}")
        raw.append(bytes.fromhex(d[len(TREE_PREFIX):]))
    return TREE_PREFIX + _combine(_FILE_DOMAIN, raw, size)


def buffer_digest(data: Buffer, chunk_bytes: int) -> str:
    """The v2 digest of a whole segment held in one buffer (cut into chunk_bytes pieces)."""
    view = memoryview(data).cast("B")
    digests = [chunk_digest(view[i:i + chunk_bytes]) for i in range(0, len(view), chunk_bytes)]
    return segment_digest(digests, len(view))


def segment_digest_like(expected: str, data: Buffer, chunk_bytes: int) -> str:
    """The digest of data in the scheme of `expected` (a v1 or v2 segment digest), to compare with it."""
    if expected.startswith(V1_SEGMENT_PREFIX):
        return V1_SEGMENT_PREFIX + xxhash.xxh3_128_hexdigest(data)
    return buffer_digest(data, chunk_bytes)


def is_tree_digest(digest: str) -> bool:
    return digest.startswith(TREE_PREFIX)


def _combine(domain: bytes, parts: Sequence[bytes], size: int) -> str:
    h = xxhash.xxh3_128()
    h.update(domain)
    h.update(struct.pack("<QQ", size, len(parts)))
    for p in parts:
        if len(p) != CHUNK_DIGEST_SIZE:
            raise ValueError(f"a digest is {CHUNK_DIGEST_SIZE} bytes, got {len(p)}")
        h.update(p)
    return h.hexdigest()


__all__ = [
    "CHUNK_DIGEST_SIZE", "TREE_PREFIX", "V1_SEGMENT_PREFIX", "buffer_digest", "chunk_digest", "file_digest",
    "is_tree_digest", "segment_digest", "segment_digest_like",
]
