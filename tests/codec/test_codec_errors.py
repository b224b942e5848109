"""decode() refuses damaged, inconsistent or hostile input with FormatError or IntegrityError, never wrong bytes."""

from __future__ import annotations

import copy
import json
from typing import Any

import numpy as np
import pytest
import zstandard
from codec_helpers import loops
from hypothesis import given, settings
from hypothesis import strategies as st

from deltafs import codec
from deltafs.codec.streams import seal
from deltafs.errors import FormatError, IntegrityError


def bf16_pair(n: int = 1 << 16, p: float = 0.01, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(new, base) bytes of a bf16 chunk where about p of the elements moved by an ulp or a few."""
    rng = np.random.default_rng(seed)
    base = ((rng.standard_normal(n) * 0.02).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    new = base.copy()
    pos = np.flatnonzero(rng.random(n) < p)
    new[pos] += rng.choice(np.array([1, 0xFFFF, 3, 0xFFF0], np.uint16), pos.size, p=[0.45, 0.45, 0.05, 0.05])
    return new.view(np.uint8), base.view(np.uint8)


def encoded(kind: str) -> tuple[codec.Encoded, np.ndarray, np.ndarray | None]:
    new, base = bf16_pair()
    if kind == "raw":
        return codec.encode(new, None, 2), new, None
    if kind == "xor":
        dense = base ^ np.random.default_rng(1).integers(0, 3, base.size, dtype=np.uint8)
        enc = codec.encode(dense, base, 2)
        assert enc.codec["name"] == "xor"
        return enc, dense, base
    if kind == "dense":
        # Every element a few ulps up or down, as F32 weights after an optimizer step.
        steps = np.random.default_rng(2).choice(np.array([-3, -2, -1, 1, 2, 3]), base.size // 2).astype(np.uint16)
        moved = (base.view("<u2") + steps).view(np.uint8)
        enc = codec.encode(moved, base, 2)
        assert enc.codec["name"] == "dense"
        return enc, moved, base
    if kind == "gamma":
        # Every element moved by steps spread over several bits (a bias after an optimizer step).
        steps = np.random.default_rng(3).integers(-300, 301, base.size // 2).astype(np.uint16)
        moved = (base.view("<u2") + steps).view(np.uint8)
        enc = codec.encode(moved, base, 2)
        assert enc.codec["name"] == "gamma"
        return enc, moved, base
    enc = codec.encode(new, base, 2)
    assert enc.codec["name"] == "sparse"
    return enc, new, base


KINDS = ["raw", "xor", "sparse", "dense", "gamma"]


def decode_or_raise(record: dict[str, Any], payload: bytes | None, base: np.ndarray | None, size: int) -> np.ndarray:
    return codec.decode(record, payload, base, size, 2)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_damaged_payload_never_decodes_to_other_bytes(kind: str, data: st.DataObject) -> None:
    enc, new, base = encoded(kind)
    assert enc.payload is not None
    damaged = bytearray(enc.payload)
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(damaged) - 1))
        damaged[i] ^= data.draw(st.integers(1, 255))
    try:
        out = decode_or_raise(enc.codec, bytes(damaged), base, new.size)
    except IntegrityError:
        out = None
    # A flip that zstd ignores (e.g. an unused header bit) is fine, as long as the bytes are still right.
    assert out is None or out.tobytes() == new.tobytes()
    if base is not None:
        # Decoding in place over the base: a refused payload leaves the base's bytes as they were.
        inplace = base.copy()
        try:
            codec.decode(enc.codec, bytes(damaged), inplace, new.size, 2, out=inplace)
        except IntegrityError:
            assert inplace.tobytes() == base.tobytes()
        else:
            assert inplace.tobytes() == new.tobytes()


@pytest.mark.parametrize("kind", KINDS)
def test_truncated_or_extended_payload(kind: str) -> None:
    enc, new, base = encoded(kind)
    assert enc.payload is not None
    for bad in (enc.payload[:-1], enc.payload[: len(enc.payload) // 2], b"", enc.payload + b"\0",
                enc.payload + enc.payload):
        with pytest.raises(IntegrityError):
            decode_or_raise(enc.codec, bad, base, new.size)


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_declared_size(kind: str) -> None:
    enc, new, base = encoded(kind)
    for size in (new.size - 2, new.size + 2):
        b = None if base is None else np.resize(base, size)
        with pytest.raises(IntegrityError):
            decode_or_raise(enc.codec, enc.payload, b, size)


def test_base_of_the_wrong_size_or_missing() -> None:
    enc, new, base = encoded("sparse")
    assert base is not None
    with pytest.raises(IntegrityError):
        codec.decode(enc.codec, enc.payload, base[:-2], new.size, 2)
    for record, payload in ((enc.codec, enc.payload), ({"name": "same"}, None), ({"name": "xor", "width": 2}, b"x")):
        with pytest.raises(FormatError):
            codec.decode(record, payload, None, new.size, 2)


def test_zstd_bomb_is_refused_before_allocating() -> None:
    # 1 GiB of zeros compresses to a few KB; its frame header declares the size.
    bomb = seal([zstandard.ZstdCompressor(level=19).compress(b"\0" * (1 << 30))])
    with pytest.raises(IntegrityError, match="declares the wrong size"):
        codec.decode({"name": "raw", "width": 1}, bomb, None, 4096, 1)
    # The same without a declared size: bounded by the chunk's size, then refused.
    unsized = seal([zstandard.ZstdCompressor(level=3, write_content_size=False).compress(b"\0" * (64 << 20))])
    with pytest.raises(IntegrityError):
        codec.decode({"name": "raw", "width": 1}, unsized, None, 4096, 1)


def test_sparse_stream_bomb_and_out_of_range_positions() -> None:
    enc, new, base = encoded("sparse")
    record = copy.deepcopy(enc.codec)
    # Declare a unary stream far larger than any valid one could be.
    record["groups"][0]["unary"] = 1 << 38
    with pytest.raises(IntegrityError):
        codec.decode(record, enc.payload, base, new.size, 2)
    # A chunk too short for the coded positions: they point past its end.
    assert base is not None
    short = new.size // 4
    with pytest.raises(IntegrityError):
        codec.decode(enc.codec, enc.payload, base[:short], short, 2)


def test_sparse_big_beyond_count_is_refused_before_any_stream_is_inflated() -> None:
    """A record's `big` sizes the big remainders and the magnitude planes; one larger than its count is refused
    before a stream is decompressed, so a frame without a declared size cannot make the decoder inflate (or try to
    allocate) what the chunk could never hold, and no MemoryError escapes."""
    enc, new, base = encoded("sparse")
    for big in (enc.codec["groups"][0]["count"] + 1, 1 << 28, 1 << 40):
        record = copy.deepcopy(enc.codec)
        record["groups"][0]["big"] = big
        for use in (True, False):
            with loops(use), pytest.raises(IntegrityError, match="more large differences than changes"):
                codec.decode(record, enc.payload, base, new.size, 2)


@pytest.mark.parametrize("name", [["sparse"], {"a": 1}, [], 3.5, None])
@pytest.mark.parametrize("width", [None, 2])
def test_codec_names_that_are_not_strings_are_format_errors(name: Any, width: int | None) -> None:
    record = {"name": name} if width is None else {"name": name, "width": width}
    with pytest.raises(FormatError):
        codec.decode(record, b"", np.zeros(16, np.uint8), 16, 2)


@pytest.mark.parametrize("shift", [1, 2, 3, 4, 8, -1, -3, -4])
@pytest.mark.parametrize("width", [2, 4])
def test_gamma_decodes_into_an_out_that_overlaps_its_base(shift: int, width: int) -> None:
    """out may be base itself (in place), or overlap it elsewhere, by whole elements or not: both paths give the
    chunk's bytes."""
    rng = np.random.default_rng(3)
    n = 4096
    dtype = np.dtype(f"<u{width}")
    base_w = rng.integers(0, 1 << (8 * width - 2), n).astype(dtype)
    new = (base_w + rng.integers(-3000, 3001, n).astype(dtype)).view(np.uint8)
    enc = codec.encode(new, base_w.view(np.uint8), width)
    assert enc.codec["name"] == "gamma"
    size = new.size
    for use in (True, False):
        with loops(use):
            buf = np.zeros(size + abs(shift), np.uint8)
            b, out = (buf[:size], buf[shift:]) if shift > 0 else (buf[-shift:], buf[:size])
            b[:] = base_w.view(np.uint8)
            assert codec.decode(enc.codec, enc.payload, b, size, width, out=out).tobytes() == new.tobytes()


def test_sparse_counts_that_disagree_with_streams() -> None:
    enc, new, base = encoded("sparse")
    for field, delta in (("count", 1), ("count", -1), ("rice", 1), ("big", 1), ("big_rice", 1)):
        record = copy.deepcopy(enc.codec)
        group = record["groups"][0]
        if group[field] + delta < 0:
            continue
        group[field] += delta
        with pytest.raises((IntegrityError, FormatError)):
            codec.decode(record, enc.payload, base, new.size, 2)


@pytest.mark.parametrize(
    "record",
    [
        {"name": "gzip"},
        {"name": "raw"},
        {"name": "raw", "width": 3},
        {"name": "raw", "width": 2, "level": 3},
        {"name": "raw", "width": True},
        {"name": "sparse", "width": 2, "split": 0, "groups": [], "frames": []},
        {"name": "sparse", "width": 2, "split": 1 << 20, "groups": [{}], "frames": []},
        {"name": "same", "extra": 1},
        {"width": 2},
        "raw",
    ],
    ids=str,
)
def test_malformed_or_unknown_records(record: Any) -> None:
    with pytest.raises(FormatError):
        codec.decode(record, b"x", np.zeros(8, np.uint8), 8, 2)


def test_look_alike_records_are_refused_after_valid_ones_were_read() -> None:
    """Valid records are parsed once and reused; values that only compare equal to them (True == 1, 2.0 == 2)
    and extra or missing fields are still refused."""
    new, base = bf16_pair()
    for kind in ("raw", "xor", "dense"):
        enc, n, b = encoded(kind)
        assert decode_or_raise(enc.codec, enc.payload, b, n.size).tobytes() == n.tobytes()
        for bad in ({**enc.codec, "width": float(enc.codec["width"])}, {**enc.codec, "width": True},
                    {"name": kind}, {**enc.codec, "split": 0}, {"name": kind, "level": 2}):
            with pytest.raises(FormatError):
                decode_or_raise(bad, enc.payload, b, n.size)
    assert decode_or_raise({"name": "same"}, None, base, base.size).tobytes() == base.tobytes()
    with pytest.raises(FormatError):
        decode_or_raise({"name": "same", "width": 2}, None, base, base.size)


@pytest.mark.parametrize("field", ["count", "rice", "unary", "big", "big_rice", "big_unary", "frames"])
@pytest.mark.parametrize("value", [True, 1.0, -1, 1 << 41, "1", None])
def test_sparse_record_fields_must_be_plain_integers_in_range(field: str, value: Any) -> None:
    enc, new, base = encoded("sparse")
    bad = copy.deepcopy(enc.codec)
    if field == "frames":
        bad["frames"][0] = value
    else:
        bad["groups"][0][field] = value
    if value == 1 << 41 and field == "frames":
        value = -1  # a frame length has no upper bound of its own; too long is the payload's problem
        bad["frames"][0] = value
    with pytest.raises(FormatError):
        decode_or_raise(bad, enc.payload, base, new.size)


@pytest.mark.parametrize("change", [
    {"width": True}, {"width": 2.0}, {"width": 3}, {"width": 4}, {"split": True}, {"split": -1},
    {"split": 1 << 15}, {"split": 1.0}, {"split": 5}, {"groups": "x"}, {"frames": "x"}, {"frames": []},
    {"extra": 1},
], ids=str)
def test_sparse_records_that_look_valid_are_refused_on_the_fast_parse_too(change: dict[str, Any]) -> None:
    """Sparse.from_json's fast path takes only what the field-by-field path accepts: each change to a valid
    record's top-level fields (a look-alike type, a value out of range, a group count that the split contradicts,
    frames of the wrong length or type, an unknown field) is still a FormatError, and the record itself parses."""
    enc, new, base = encoded("sparse")
    assert decode_or_raise(enc.codec, enc.payload, base, new.size).tobytes() == new.tobytes()
    with pytest.raises(FormatError):
        decode_or_raise({**copy.deepcopy(enc.codec), **change}, enc.payload, base, new.size)


def test_same_refuses_a_payload_and_odd_width() -> None:
    with pytest.raises(FormatError):
        codec.decode({"name": "same"}, b"x", np.zeros(8, np.uint8), 8, 2)
    payload = codec.encode(np.zeros(6, np.uint8), None, 2).payload
    with pytest.raises(FormatError):
        codec.decode({"name": "raw", "width": 4}, payload, None, 6, 4)


@pytest.mark.parametrize("kind", KINDS + ["same"])
def test_codec_records_roundtrip_through_json(kind: str) -> None:
    if kind == "same":
        rec: dict[str, Any] = {"name": "same"}
    else:
        rec = encoded(kind)[0].codec
    text = json.dumps(rec, sort_keys=True, separators=(",", ":"))
    parsed = codec.from_json(json.loads(text))
    assert parsed.to_json() == rec
    assert json.dumps(parsed.to_json(), sort_keys=True, separators=(",", ":")) == text
    assert type(parsed).name == kind
    assert set(codec.registered()) == {"same", "raw", "xor", "sparse", "dense", "gamma"}


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_hostile_sparse_records_and_streams_fail_cleanly(data: st.DataObject) -> None:
    """Any record that parses, with any sealed payload, decodes or raises FormatError/IntegrityError; never
    another exception, a hang or an oversized allocation."""
    width = data.draw(st.sampled_from([1, 2, 4]))
    n = data.draw(st.integers(1, 300))
    split = data.draw(st.sampled_from([0, 1, 100, (1 << (8 * width - 1)) - 1]))
    groups = []
    for _ in range(2 if split else 1):
        groups.append({k: data.draw(st.integers(0, 40)) for k in ("count", "unary", "big", "big_unary")}
                      | {"rice": data.draw(st.integers(0, 32)), "big_rice": data.draw(st.integers(0, 32))})
    streams_ = [data.draw(st.binary(max_size=24)) for _ in range(len(groups) * (5 + width))]
    record = {"name": "sparse", "width": width, "split": split, "groups": groups,
              "frames": [len(s) for s in streams_]}
    base = np.frombuffer(data.draw(st.binary(min_size=n * width, max_size=n * width)), np.uint8)
    try:
        out = codec.decode(record, seal(streams_), base, n * width, width)
    except (FormatError, IntegrityError):
        return
    assert out.size == n * width


@pytest.mark.parametrize("level", [codec.DEFAULT_LEVEL, codec.SPLIT_LEVEL])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_resealed_damage_inside_streams_fails_cleanly(level: int, data: st.DataObject) -> None:
    """Damage that keeps the checksum valid (a writer bug, not the wire) still never crashes the decoder."""
    new, base = bf16_pair(n=1 << 14, p=0.03, seed=data.draw(st.integers(0, 3)))
    enc = codec.encode(new, base, 2, level=level)
    assert enc.payload is not None
    body = bytearray(enc.payload[:-8])
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(body) - 1))
        body[i] = data.draw(st.integers(0, 255))
    try:
        out = codec.decode(enc.codec, seal([bytes(body)]), base, new.size, 2)
    except (FormatError, IntegrityError):
        return
    assert out.size == new.size
