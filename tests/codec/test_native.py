"""The codec's compiled loops (deltafs/codec/_native.c) against the numpy code they replace: same bytes, same refusals."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltafs import codec
from deltafs.codec import native, streams
from deltafs.errors import IntegrityError

built = pytest.mark.skipif(not native.BUILT, reason="deltafs.codec._native was not built (no C compiler)")


def _both(fn: Callable[..., Any], *args: Any) -> list[Any]:
    """fn(*args) with the compiled loops, then with numpy: each a result or the IntegrityError's message."""
    out: list[Any] = []
    try:
        for use in (True, False):
            native.enabled = use
            try:
                out.append(fn(*args))
            except IntegrityError as exc:
                out.append(f"IntegrityError: {exc}")
    finally:
        native.enabled = native.BUILT
    return out


def _compiled_rice(gaps: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The compiled Rice encoder (the loop native.group runs) on gaps at any k, with the streams' exact sizes."""
    assert native.module is not None
    unary = np.empty((int((gaps >> k).sum()) + gaps.size + 7) // 8, np.uint8)
    remainder = np.empty((gaps.size * k + 7) // 8, np.uint8)
    native.module.encode(gaps, k, unary, remainder)
    return unary, remainder


def _compiled_signs(diff: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The compiled sign and magnitude pass (the loop native.group runs), shaped as codecs._signs_and_big's result."""
    assert native.module is not None
    count, width = diff.size, diff.dtype.itemsize
    signs = np.empty((count + 7) // 8, np.uint8)
    big_at, big = np.empty(count, np.int64), np.empty(count, diff.dtype)
    nbig = native.module.signs(diff, width, signs, big_at, big)
    return signs, big_at[:nbig], big[:nbig]


def test_the_module_is_built_where_a_compiler_is() -> None:
    """CI has a compiler: if the build silently skipped the module there, the fast path would go untested."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None or os.environ.get("DELTAFS_ALLOW_NO_NATIVE"):
        pytest.skip("no C compiler here")
    assert native.BUILT and native.enabled


@built
@settings(max_examples=300, deadline=None)
@given(gaps=st.lists(st.integers(0, 2**20), min_size=1, max_size=300), k=st.integers(0, 32))
def test_same_streams_and_positions(gaps: list[int], k: int) -> None:
    g = np.array(gaps, dtype=np.int64)
    (u1, r1), (u0, r0) = _compiled_rice(g, k), streams.rice_encode(g, k)
    assert u1.tobytes() == u0.tobytes() and r1.tobytes() == r0.tobytes()
    positions = np.cumsum(g + 1) - 1
    end = int(positions[-1]) + 1
    for count, e in ((g.size, end), (g.size, end - 1), (g.size + 1, end), (g.size - 1, end), (g.size, 1 << 62)):
        if count < 1:
            continue
        a, b = _both(streams.rice_positions, u1, r1, count, k, e, "t")
        if isinstance(a, str) or isinstance(b, str):
            assert a == b
        else:
            assert np.array_equal(a, b) and np.array_equal(a, positions)
    # A zero byte after the last code: refused by both (trailing bytes), although every position is in range.
    a, b = _both(streams.rice_positions, np.append(u1, np.uint8(0)), r1, g.size, k, 1 << 62, "t")
    assert a == b and "trailing bytes" in a


@built
@settings(max_examples=500, deadline=None)
@given(unary=st.binary(min_size=0, max_size=64), remainder=st.binary(max_size=64), count=st.integers(1, 80),
       k=st.integers(0, 32), end=st.integers(1, 1 << 62))
def test_same_answer_on_arbitrary_bytes(unary: bytes, remainder: bytes, count: int,
                                        k: int, end: int) -> None:
    """Hostile streams: the compiled loop accepts exactly what numpy accepts, with the same positions."""
    u = np.frombuffer(unary, np.uint8)
    # Give the remainder stream its expected size half the time, so the decode gets past the cheap checks.
    r = np.frombuffer(remainder, np.uint8)
    if count * k and len(remainder) % 2:
        r = np.resize(r if r.size else np.zeros(1, np.uint8), (count * k + 7) // 8)
        r[-1] &= (0xFF << ((-count * k) % 8)) & 0xFF
    a, b = _both(streams.rice_positions, u, r, count, k, end, "t")
    if isinstance(a, str) or isinstance(b, str):
        assert a == b
    else:
        assert np.array_equal(a, b)


@built
def test_long_zero_runs_and_the_widest_fields() -> None:
    """Quotients spanning many zero bytes, k = 32 remainders near 2**32, and the overflow bound of end."""
    g = np.array([(1 << 32) - 1, 5 << 32, 0, (1 << 33) + 7], dtype=np.int64)
    (u1, r1), (u0, r0) = _compiled_rice(g, 32), streams.rice_encode(g, 32)
    assert u1.tobytes() == u0.tobytes() and r1.tobytes() == r0.tobytes()
    positions = np.cumsum(g + 1) - 1
    a, b = _both(streams.rice_positions, u1, r1, g.size, 32, 1 << 40, "t")
    assert np.array_equal(a, positions) and np.array_equal(b, positions)
    a, b = _both(streams.rice_positions, u1, r1, g.size, 32, int(positions[-1]), "t")
    assert a == b and "gap out of range" in a


@built
def test_compiled_encode_refuses_negative_gaps() -> None:
    c = native.module
    assert c is not None
    with pytest.raises(ValueError):
        c.encode(np.array([3, -1], np.int64), 2, np.zeros(2, np.uint8), np.zeros(1, np.uint8))
    with pytest.raises(ValueError):  # output buffers that do not match the streams' sizes
        c.encode(np.array([3, 1], np.int64), 2, np.zeros(5, np.uint8), np.zeros(1, np.uint8))


def _chunk(data: st.DataObject, width: int) -> tuple[np.ndarray, np.ndarray]:
    """A base and a new chunk (uint8) of width-byte elements: a few changes, mostly +-1, some large."""
    n = data.draw(st.integers(8, 3000) | st.integers(4096, 20000))  # from 4096 elements level 5 may split
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    dtype = streams.UINT[width]
    base = rng.integers(0, 1 << (8 * width - 1), n, dtype=np.uint64).astype(dtype)
    # Floats keep small and large magnitudes apart (the split of level 5 uses that): mix in small values.
    base[rng.random(n) < 0.3] >>= dtype.type(8 * width // 2)
    new = base.copy()
    # Small weights change more often (as after an optimizer step), so that splitting by magnitude pays.
    rate = data.draw(st.sampled_from([0.002, 0.02, 0.1]))
    small = base < dtype.type(1 << (8 * width // 2))
    at = np.flatnonzero(rng.random(n) < np.where(small, 10 * rate, rate))
    at = at if at.size else np.array([n // 2])
    step = rng.choice(np.array([1, -1, 2, -3, 200, -(1 << (8 * width - 2))], np.int64), at.size)
    new[at] = (base[at].astype(np.int64) + step).astype(dtype)  # wraps
    return base.view(np.uint8), new.view(np.uint8)


@built
@settings(max_examples=200, deadline=None)
@given(width=st.sampled_from([1, 2, 4, 8]), level=st.sampled_from([3, 5]), data=st.data())
def test_sparse_decodes_alike(width: int, level: int, data: st.DataObject) -> None:
    """Sparse chunks (both split classes at level 5) decode to the new bytes with either path, in place or not."""
    base, new = _chunk(data, width)
    enc = codec.encode(new, base, width, level=level)

    def decode(in_place: bool) -> bytes:
        out = base.copy()
        return codec.decode(enc.codec, enc.payload, out if in_place else base, out.size, width, out=out).tobytes()

    for in_place in (True, False):
        a, b = _both(decode, in_place)
        assert a == b == new.tobytes()


@built
@settings(max_examples=300, deadline=None)
@given(width=st.sampled_from([2, 4]), data=st.data())
def test_damaged_sparse_payloads_are_refused_alike(width: int, data: st.DataObject) -> None:
    """A byte of a sparse payload changed (its trailer made to match): both paths give the same bytes or refusal,
    and a refused in-place decode leaves the base as it was."""
    base, new = _chunk(data, width)
    enc = codec.encode(new, base, width, level=data.draw(st.sampled_from([3, 5])))
    if enc.codec["name"] != "sparse":
        return
    body = bytearray(enc.payload[:-streams.TRAILER])
    at = data.draw(st.integers(0, len(body) - 1))
    body[at] ^= data.draw(st.integers(1, 255))
    payload = streams.seal([bytes(body)])

    def decode() -> bytes:
        out = base.copy()
        try:
            return codec.decode(enc.codec, payload, out, out.size, width, out=out).tobytes()
        except IntegrityError:
            assert out.tobytes() == base.tobytes()
            raise

    a, b = _both(decode)
    assert a == b


@built
def test_compiled_apply_refuses_what_the_decoder_would_never_pass() -> None:
    """Indexes outside the chunk or unordered large-difference indexes: refused before a byte is written."""
    c = native.module
    assert c is not None
    out = np.zeros(16, np.uint8)
    signs = np.zeros(1, np.uint8)
    none = np.empty(0, np.int64)
    assert c.apply(out, 2, np.array([8], np.int64), signs, none, b"") == 1  # element 8 of 8
    assert c.apply(out, 2, np.array([1, 2], np.int64), signs, np.array([1, 0], np.int64), b"\0" * 4) == 2
    assert c.apply(out, 2, np.array([1, 2], np.int64), signs, np.array([2], np.int64), b"\0" * 2) == 2
    assert not out.any()
    assert c.apply(out, 2, np.array([0, 7], np.int64), np.array([0x40], np.uint8), np.array([0], np.int64), b"\1\0") == 0
    assert out.view("<u2").tolist() == [3, 0, 0, 0, 0, 0, 0, 0xFFFF]


def _one_class(width: int, seed: int) -> tuple[np.ndarray, np.ndarray, codec.Encoded]:
    """A sparse chunk of one class (level 3: no split) with large differences, and its encoding."""
    rng = np.random.default_rng(seed)
    dtype = streams.UINT[width]
    base = rng.integers(0, 1 << (8 * width - 1), 5000, dtype=np.uint64).astype(dtype)
    new = base.copy()
    at = np.flatnonzero(rng.random(base.size) < 0.03)
    new[at] = (base[at].astype(np.int64) + rng.choice(np.array([1, -1, 7, -300]), at.size)).astype(dtype)
    enc = codec.encode(new.view(np.uint8), base.view(np.uint8), width, level=3)
    assert enc.codec["name"] == "sparse" and enc.codec["split"] == 0
    return base.view(np.uint8), new.view(np.uint8), enc


@built
@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_one_class_chunks_decode_in_one_compiled_call(width: int) -> None:
    """The usual sparse chunk (no split) takes native.ungroup, into a separate out and in place; a payload the
    compiled checks refuse returns None with out untouched (the numpy path then names the problem)."""
    from deltafs.codec.codecs import Sparse
    from deltafs.codec.registry import from_json

    base, new, enc = _one_class(width, seed=width)
    rec = from_json(enc.codec)
    assert isinstance(rec, Sparse)
    c = native.module
    body = streams.unseal(enc.payload, "test")
    n = base.size // width
    out = np.zeros_like(base)
    assert rec._decode_compiled(c, body, base, n, out) is out
    assert out.tobytes() == new.tobytes()
    inplace = base.copy()
    assert rec._decode_compiled(c, body, inplace, n, inplace) is inplace
    assert inplace.tobytes() == new.tobytes()
    # Out overlapping base other than exactly: refused (status 6), nothing written; decode() then copies as numpy.
    room = np.concatenate([base, np.zeros(width, np.uint8)])
    shifted = room[width:]
    assert rec._decode_compiled(c, body, room[:base.size], n, shifted) is None
    assert not shifted[-width:].any()
    # A position gap's end bit cleared: one gap fewer than the record lists, refused before anything is written.
    assert rec.frames[0] == rec.groups[0].unary  # the gap stream is stored raw
    damaged = bytearray(body)
    assert damaged[0]  # holds the end of at least one gap
    damaged[0] = 0
    untouched = base.copy()
    assert rec._decode_compiled(c, memoryview(damaged), untouched, n, untouched) is None
    assert untouched.tobytes() == base.tobytes()


@built
def test_compiled_ungroup_refuses_streams_of_the_wrong_shape() -> None:
    """Each shape check of native.ungroup: a non-zero status and out untouched."""
    c = native.module
    assert c is not None
    base, new, enc = _one_class(2, seed=7)
    from deltafs.codec.codecs import Sparse
    from deltafs.codec.registry import from_json

    rec = from_json(enc.codec)
    assert isinstance(rec, Sparse)
    g = rec.groups[0]
    body = bytes(streams.unseal(enc.payload, "test"))
    sizes = g.stream_sizes(2)
    parts, pos = [], 0
    for j, plain in enumerate(sizes):
        stored = rec.frames[j]
        piece = body[pos:pos + stored]
        parts.append(piece if stored == plain else streams.decompress(piece, plain, "t").tobytes())
        pos += stored
    planes = b"".join(parts[5:])
    n = base.size // 2

    def run(*args: Any) -> int:
        out = base.copy()
        status = c.ungroup(out, None, *args)
        if status:
            assert out.tobytes() == base.tobytes()
        else:
            assert out.tobytes() == new.tobytes()
        return int(status)

    good = (2, n, g.count, g.rice, g.big, g.big_rice, *parts[:5], planes)
    assert run(*good) == 0
    assert run(2, n, g.count, g.rice, g.big, g.big_rice, *parts[:5], planes[:-1]) != 0  # planes short
    assert run(2, n, g.count, g.rice, g.big, g.big_rice, parts[0], parts[1][:-1], *parts[2:5], planes) != 0
    signs = bytearray(parts[2])
    if g.count % 8:
        signs[-1] |= 1  # padding bit set
        assert run(2, n, g.count, g.rice, g.big, g.big_rice, parts[0], parts[1], bytes(signs), *parts[3:5],
                   planes) != 0
    assert run(2, n, g.count, g.rice, g.count + 1, g.big_rice, *parts[:5], planes) != 0  # big > count
    with pytest.raises(ValueError, match="space elements"):  # the caller's sizes disagree: a bug, not a payload
        c.ungroup(base.copy(), None, 2, n + 1, g.count, g.rice, g.big, g.big_rice, *parts[:5], planes)
    with pytest.raises(ValueError, match="width"):
        c.ungroup(base.copy(), None, 3, n, g.count, g.rice, g.big, g.big_rice, *parts[:5], planes)


@built
@settings(max_examples=150, deadline=None)
@given(width=st.sampled_from([1, 2, 4, 8]), n=st.integers(1, 5000), seed=st.integers(0, 2**32 - 1),
       shift=st.integers(-3, 3))
def test_dense_decodes_alike(width: int, n: int, seed: int, shift: int) -> None:
    """Every element moved a little (dense): the same bytes with either path, in place, into a separate buffer,
    and into a view that overlaps the base at another offset (the compiled loop leaves that case to numpy)."""
    rng = np.random.default_rng(seed)
    dtype = streams.UINT[width]
    base = rng.integers(0, 1 << (8 * width - 1), n, dtype=np.uint64).astype(dtype)
    new = (base.astype(np.int64) + rng.integers(-40, 40, n)).astype(dtype)
    enc = codec.encode(new.view(np.uint8), base.view(np.uint8), width)
    if enc.codec["name"] != "dense":
        return
    size = n * width

    def decode(mode: str) -> bytes:
        if mode == "overlap":
            room = np.zeros(size + 3 * width * 2, np.uint8)
            b = room[3 * width: 3 * width + size]
            b[:] = base.view(np.uint8)
            out = room[3 * width + shift * width: 3 * width + shift * width + size]
            return codec.decode(enc.codec, enc.payload, b, size, width, out=out).tobytes()
        b = base.view(np.uint8).copy()
        out = b if mode == "in place" else np.empty(size, np.uint8)
        return codec.decode(enc.codec, enc.payload, b, size, width, out=out).tobytes()

    for mode in ("in place", "separate", "overlap"):
        a, b = _both(decode, mode)
        assert a == b == new.tobytes(), mode


@built
def test_the_codec_suite_passes_without_the_compiled_loops() -> None:
    """An install without a C compiler runs the numpy code alone: the codec's own tests, in a process that starts
    with the loops off (DELTAFS_NATIVE=0), pass as they do with them."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "DELTAFS_NATIVE": "0", "DELTAFS_ALLOW_NO_NATIVE": "1"}
    check = subprocess.run([sys.executable, "-c", "from deltafs.codec import native; assert native.loops() is None"],
                           env=env, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", here,
                          "--ignore", os.path.join(here, "test_native.py")], env=env, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]


@built
@settings(max_examples=200, deadline=None)
@given(width=st.sampled_from([1, 2, 4, 8]), level=st.sampled_from([1, 3, 5]), data=st.data())
def test_encodes_alike(width: int, level: int, data: st.DataObject) -> None:
    """The same codec record and payload from either path: sparse steps, dense steps (every element moved), and
    unrelated values, small chunks and large."""
    base, new = _chunk(data, width)
    kind = data.draw(st.sampled_from(["steps", "dense", "unrelated"]))
    if kind != "steps":
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        dtype = streams.UINT[width]
        b = base.view(dtype)
        moved = (b.astype(np.int64) + rng.integers(-9, 9, b.size)) if kind == "dense" else rng.integers(0, 255, b.size)
        new = moved.astype(dtype).view(np.uint8)
    a, b2 = _both(lambda: codec.encode(new, base, width, level=level))
    assert (a.codec, a.payload, a.changed) == (b2.codec, b2.payload, b2.changed)


@built
@settings(max_examples=60, deadline=None)
@given(width=st.sampled_from([1, 2, 4, 8]), n=st.sampled_from([1, 7, 33, 1000, 70_000, 300_000]),
       rate=st.sampled_from([0.0, 0.001, 0.3, 1.0]), seed=st.integers(0, 2**32 - 1))
def test_changes_alike(width: int, n: int, rate: float, seed: int) -> None:
    """The compare that starts every delta: same indexes and values, from a chunk whose length is not a whole
    number of 8-byte words to more changes than the compiled pass first makes room for (a second pass)."""
    from deltafs.codec import compare

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, n * width, dtype=np.uint8)
    new = base.copy()
    hit = rng.random(n * width) < rate / width
    new[hit] ^= rng.integers(1, 256, int(hit.sum()), dtype=np.uint8)
    a, b = _both(compare.changes, new, base, width)
    assert all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(a, b, strict=True))


@built
@settings(max_examples=300, deadline=None)
@given(width=st.sampled_from([1, 2, 4, 8]), n=st.sampled_from([0, 1, 7, 15, 16, 17, 31, 32, 33, 64, 65, 1000, 4097, 70_000]),
       rate=st.sampled_from([0.0, 0.001, 0.02, 0.3, 1.0]), room=st.sampled_from([0, 1, 5, 8, 16, 17, 40, None]),
       seed=st.integers(0, 2**32 - 1))
def test_changes_vector_loops_match_the_scalar_ones(width: int, n: int, rate: float, room: int | None,
                                                    seed: int) -> None:
    """Where the compare runs vector loops (x86-64 hosts with AVX-512 or AVX2), each level this host has finds exactly
    what the scalar loops find, also with less room than there are changes (what fits is written, the rest
    counted). Entries past the count are scratch (the caller keeps the first count; the AVX2 loops store whole
    vectors), and nothing is written past the room (the buffers end there: AddressSanitizer runs of this test
    would report it)."""
    from deltafs.codec import _native

    if not _native.simd():
        pytest.skip("this host has neither AVX-512 (avx512f, avx512bw, avx512vbmi2) nor AVX2: only the scalar loops run")
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, n * width, dtype=np.uint8)
    new = base.copy()
    hit = rng.random(n * width) < rate / width
    new[hit] ^= rng.integers(1, 256, int(hit.sum()), dtype=np.uint8)
    cap = n if room is None else room
    out = []
    for level in range(_native.simd() + 1):  # 0: the scalar loops
        idx = np.full(cap, -7, np.int64)
        nv, bv = np.full(cap * width, 0xAB, np.uint8), np.full(cap * width, 0xCD, np.uint8)
        count = _native.changes(new, base, width, idx, nv, bv, level)
        kept = min(count, cap)
        out.append((count, idx[:kept].tobytes(), nv[:kept * width].tobytes(), bv[:kept * width].tobytes()))
    assert all(o == out[0] for o in out[1:])
    assert out[0][0] == (int(np.count_nonzero((new != base).reshape(-1, width).any(axis=1))) if n else 0)


@built
@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(["bf16", "f32", "f64"]), n=st.sampled_from([300, 5000, 70_000, 600_000]),
       rate=st.sampled_from([0.003, 0.02, 0.05, 0.3, 0.97]), seed=st.integers(0, 2**32 - 1))
def test_every_compare_level_writes_the_same_payload(dtype: str, n: int, rate: float, seed: int) -> None:
    """A trainer-like step (small steps on a few percent of the elements, or on nearly all) encodes to the same codec
    record and payload whichever compare runs (DELTAFS_SIMD's levels: scalar, AVX2, AVX-512, as far as this host
    has them), and decodes back to the new bytes."""
    rng = np.random.default_rng(seed)
    if dtype == "f64":
        base = rng.standard_normal(n)
    else:
        base = rng.standard_normal(n).astype(np.float32)
    moved = base * (1 + 1e-3 * rng.standard_normal(n)).astype(base.dtype)
    new = np.where(rng.random(n) < rate, moved, base).astype(base.dtype)
    if dtype == "bf16":  # the upper halves of F32: bf16 bit patterns
        base, new = (base.view(np.uint32) >> 16).astype(np.uint16), (new.view(np.uint32) >> 16).astype(np.uint16)
    width = base.dtype.itemsize
    b8, n8 = base.view(np.uint8), new.view(np.uint8)
    host = native.simd_level
    out = []
    try:
        for level in range(host + 1):
            native.simd_level = level
            enc = codec.encode(n8, b8, width, level=3)
            out.append((enc.codec, enc.payload, enc.changed))
    finally:
        native.simd_level = host
    assert all(o == out[0] for o in out[1:])
    codec_rec, payload, _ = out[0]
    assert codec.decode(codec_rec, payload, b8, n8.size, width).tobytes() == n8.tobytes()


def test_deltafs_simd_caps_the_compare_level() -> None:
    """DELTAFS_SIMD=0 in the environment starts a process whose compare runs the scalar loops, and `deltafs env` says
    so; an unknown value is ignored."""
    probe = "from deltafs.codec import native; print(native.simd_level, native.describe())"
    for value, expect in (("0", "0"), ("junk", None)):
        run = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "DELTAFS_SIMD": value},
                             capture_output=True, text=True, check=True)
        level, text = run.stdout.split(" ", 1)
        if not native.BUILT or os.environ.get("DELTAFS_NATIVE") == "0":  # what the child's environment decides
            assert text.startswith("numpy")
            continue
        if expect is not None:
            assert level == expect and "compare scalar (DELTAFS_SIMD)" in text, text
        else:
            assert int(level) == native.simd_level and "(DELTAFS_SIMD)" not in text, text


@built
@settings(max_examples=200, deadline=None)
@given(gaps=st.lists(st.one_of(st.integers(0, 40), st.integers(0, 2**40)), min_size=1, max_size=400),
       total_known=st.booleans())
def test_rice_streams_alike(gaps: list[int], total_known: bool) -> None:
    """The compiled group encoder's Rice parameter search (each k priced in one pass, no quotient arrays) settles on
    the same k and writes the same two streams as numpy's, from small gaps to ones that need k near its limit. The
    gaps are a class's: the ranks they lead to, the last one up to the sentinel rank `space`."""
    g = np.array(gaps, dtype=np.int64)
    total = int(g.sum()) if total_known else None
    positions = np.cumsum(g + 1) - 1
    ranks, space = positions[:-1], int(positions[-1])
    assert native.module is not None
    k1, u1, r1 = native.module.group(ranks, np.zeros(ranks.size, np.uint16), 2, space)[:3]
    k0, u0, r0 = streams.rice_streams(g, total)
    assert (k1, u1, r1) == (k0, u0.tobytes(), r0.tobytes())
    assert k1 == streams.best_rice_k(g, total)


@built
@settings(max_examples=200, deadline=None)
@given(width=st.sampled_from([1, 2, 4, 8]), count=st.integers(1, 70), seed=st.integers(0, 2**32 - 1))
def test_signs_and_magnitudes_alike(width: int, count: int, seed: int) -> None:
    """A sparse group's sign bits, big-change indexes and magnitudes from the compiled pass and from numpy: counts
    that do not fill the last sign byte, +-1 steps among larger ones, and the extremes (the most negative value,
    whose magnitude is itself)."""
    from deltafs.codec.codecs import _signs_and_big

    dtype = streams.UINT[width]
    rng = np.random.default_rng(seed)
    top = (1 << (8 * width)) - 1
    pick = rng.integers(0, 5, count)
    raw = np.where(pick == 0, 1, np.where(pick == 1, top, rng.integers(0, top, count, dtype=np.uint64, endpoint=True)))
    raw[rng.integers(0, count)] = 1 << (8 * width - 1)
    diff = raw.astype(dtype)
    a, b = _compiled_signs(diff), _signs_and_big(diff)
    assert all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(a, b, strict=True))


@built
@settings(max_examples=150, deadline=None)
@given(gaps=st.lists(st.integers(0, 2**12), min_size=1, max_size=200), k=st.integers(1, 32),
       short=st.integers(1, 8))
def test_positions_refuses_a_short_remainder_stream(gaps: list[int], k: int, short: int) -> None:
    """A remainder stream cut short is refused (status 4), never read past its end: the cut stream is a view into
    the whole one, so a read beyond the cut would find the real bytes and succeed."""
    assert native.module is not None
    g = np.array(gaps, dtype=np.int64)
    unary, remainder = _compiled_rice(g, k)
    cut = max(0, remainder.size - short)
    out = np.empty(g.size, np.int64)
    end = int((np.cumsum(g + 1) - 1)[-1]) + 1
    assert native.module.positions(unary, remainder, g.size, k, end, out) == 0
    assert native.module.positions(unary, memoryview(remainder)[:cut], g.size, k, end, out) == 4


@built
@settings(max_examples=300, deadline=None)
@given(width=st.sampled_from([1, 2, 4, 8]), space=st.integers(0, 5000), rate=st.sampled_from([0.0, 0.002, 0.05, 0.6, 1.0]),
       ones=st.sampled_from([0.0, 0.5, 1.0]), seed=st.integers(0, 2**32 - 1))
def test_group_streams_alike(width: int, space: int, rate: float, ones: float, seed: int) -> None:
    """One sparse class's streams from the compiled group encoder and from numpy: the same Group record (Rice
    parameters, counts) and the same bytes in every stream, for empty classes, classes where every element changed,
    no +-1 steps, only +-1 steps, and the extreme differences."""
    from deltafs.codec.codecs import _group_streams

    rng = np.random.default_rng(seed)
    ranks = np.flatnonzero(rng.random(space) < rate).astype(np.int64)
    dtype = streams.UINT[width]
    top = (1 << (8 * width)) - 1
    wide = rng.integers(0, top, ranks.size, dtype=np.uint64, endpoint=True)
    step = np.where(rng.random(ranks.size) < 0.5, 1, top)
    diff = np.where(rng.random(ranks.size) < ones, step, wide).astype(dtype)
    if diff.size:
        diff[rng.integers(0, diff.size)] = 1 << (8 * width - 1)
    (g1, p1, t1), (g0, p0, t0) = _both(_group_streams, ranks, diff, space)
    assert g1 == g0 and t1 == t0
    assert [bytes(p) for p in p1] == [np.ascontiguousarray(p).tobytes() for p in p0]


@built
def test_group_refuses_ranks_out_of_order_or_range() -> None:
    assert native.module is not None
    diff = np.ones(3, np.uint16)
    for ranks in ([1, 1, 2], [3, 2, 5], [0, 1, 10], [-1, 0, 1]):
        with pytest.raises(ValueError, match="ascending"):
            native.module.group(np.array(ranks, np.int64), diff, 2, 10)
    with pytest.raises(ValueError):
        native.module.group(np.array([0, 1], np.int64), diff, 2, 10)  # one difference per rank
    assert native.module.group(np.array([0, 5, 9], np.int64), diff, 2, 10)[4] == 0  # no big changes


@built
@settings(max_examples=150, deadline=None)
@given(width=st.sampled_from([1, 2, 4, 8]), elements=st.integers(1, 3000), rate=st.sampled_from([0.0, 0.001, 0.05, 0.1, 0.3]),
       seed=st.integers(0, 2**32 - 1))
def test_changes_group_alike(width: int, elements: int, rate: float, seed: int) -> None:
    """The compare and group in one call (native.changes_group, through compare.changes_or_group): the streams of
    native.group on compare.changes' result where at least one and at most a tenth of the elements changed, else
    those changes themselves; and encode() gives the bytes it gives without the compiled loops."""
    from deltafs.codec import compare

    rng = np.random.default_rng(seed)
    dtype = streams.UINT[width]
    base = rng.integers(0, 2 ** (8 * width) - 1, elements, dtype=dtype, endpoint=True)
    new = base.copy()
    at = rng.random(elements) < rate
    steps = rng.choice(np.array([1, 2 ** (8 * width) - 1, 2, 300 % 2 ** (8 * width)], dtype=dtype), elements)
    new[at] += steps[at]
    n, b = new.view(np.uint8), base.view(np.uint8)
    assert native.module is not None
    idx, nv, bv = compare.changes(n, b, width)
    found, grouped = compare.changes_or_group(native.module, n, b, width, 0.1)
    if idx.size and idx.size / elements <= 0.1:
        assert found is None and grouped is not None
        k, u, r, s, big, big_k, bu, br, planes = native.module.group(idx, nv - bv, width, elements)
        assert grouped[:9] == (idx.size, k, u, r, s, big, big_k, bu, br)
        assert b"".join(grouped[9:]) == planes and len(grouped) == 9 + width
    else:
        assert grouped is None and found is not None
        for x, y in zip(found, (idx, nv, bv), strict=True):
            assert np.array_equal(x, y)
    a, c = _both(lambda: codec.encode(n, b, width))
    assert (a.codec, a.payload, a.changed) == (c.codec, c.payload, c.changed)


@built
@settings(max_examples=200, deadline=None)
@given(width=st.sampled_from([2, 4]), elements=st.integers(16, 4000), rate=st.floats(0.5, 0.95),
       step=st.sampled_from(["ulp", "small", "wide", "bits"]), level=st.sampled_from([1, 3, 5]),
       seed=st.integers(0, 2**32 - 1))
def test_a_small_chunk_mostly_changed_encodes_alike_on_both_paths(width: int, elements: int, rate: float, step: str,
                                                                  level: int, seed: int) -> None:
    """Small chunks with half or more of their elements changed take the compiled shortcuts (gamma counted and
    written in one call; sparse's streams from the compare's call, tried against the dense or gamma payload in
    hand): the same record, payload and count as the numpy path, whichever codec wins."""
    rng = np.random.default_rng(seed)
    dtype = streams.UINT[width]
    if width == 4:
        base = (0.02 * rng.standard_normal(elements)).astype(np.float32).view(dtype)
    else:
        base = rng.integers(0x3000, 0x3f00, elements).astype(dtype)
    bits = 8 * width
    at = rng.random(elements) < rate
    size = {"ulp": 2, "small": 1 << 6, "wide": 1 << (bits // 2), "bits": 1 << (bits - 2)}[step]
    steps = rng.integers(-size, size + 1, elements)
    new = (base.astype(np.int64) + np.where(at, steps, 0)).astype(np.uint64).astype(dtype)
    n, b = new.view(np.uint8), base.view(np.uint8)
    a, c = _both(lambda: codec.encode(n, b, width, level=level))
    assert (a.codec, a.payload, a.changed) == (c.codec, c.payload, c.changed)
    assert codec.decode(a.codec, a.payload, b, b.size, width).tobytes() == n.tobytes()
