"""Format v2 digests: the same bytes give the same digest whatever the order chunks were hashed in."""

from __future__ import annotations

import os
import random

import pytest
import xxhash

from deltafs.format.digests import (
    buffer_digest,
    chunk_digest,
    file_digest,
    segment_digest,
    segment_digest_like,
)


def test_chunk_digests_in_any_order_give_the_buffer_digest():
    data = os.urandom(10_000)
    pieces = [(i, data[i:i + 1024]) for i in range(0, len(data), 1024)]
    random.Random(0).shuffle(pieces)
    by_index = {i: chunk_digest(p) for i, p in pieces}
    combined = segment_digest([by_index[i] for i in sorted(by_index)], len(data))
    assert combined == buffer_digest(data, 1024)
    assert combined.startswith("xxh3-tree:") and len(combined) == len("xxh3-tree:") + 32


def test_one_flipped_bit_or_other_cut_changes_the_digest():
    data = bytearray(os.urandom(4096))
    before = buffer_digest(data, 1024)
    data[3000] ^= 1
    assert buffer_digest(data, 1024) != before
    data[3000] ^= 1
    assert buffer_digest(data, 1024) == before
    assert buffer_digest(data, 2048) != before  # the chunk size is part of what is hashed


def test_empty_segment_and_file_digests_are_defined_and_distinct():
    empty = segment_digest([], 0)
    assert empty == buffer_digest(b"", 8)
    assert file_digest([], 0) != empty
    assert file_digest([empty], 0) != file_digest([], 0)


def test_file_digest_depends_on_segment_order():
    a, b = buffer_digest(b"a" * 16, 8), buffer_digest(b"b" * 16, 8)
    assert file_digest([a, b], 32) != file_digest([b, a], 32)
    with pytest.raises(ValueError):
        file_digest(["xxh3-128:" + "0" * 32], 32)


def test_digest_like_speaks_v1_and_v2():
    data = os.urandom(100)
    v1 = "xxh3-128:" + xxhash.xxh3_128_hexdigest(data)
    assert segment_digest_like(v1, data, 64) == v1
    v2 = buffer_digest(data, 64)
    assert segment_digest_like(v2, data, 64) == v2
