"""codec.encode with the changed elements given (`known`, from a device-side diff) writes exactly the payload it
writes when it looks for them itself, also when the indices include elements that did not change."""

from __future__ import annotations

import numpy as np
import pytest

from deltafs import codec


def _pair(n: int, width: int, every: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    dtype = {2: np.uint16, 4: np.uint32}[width]
    base = rng.integers(0, 2 ** (8 * width), n, dtype=np.uint64).astype(dtype)
    new = base.copy()
    new[::every] += rng.integers(1, 3, new[::every].size, dtype=np.uint64).astype(dtype)  # +1 or +2 ulps
    return new.view(np.uint8), base.view(np.uint8)


@pytest.mark.parametrize("width,n,every,level", [(2, 1 << 19, 97, 3), (2, 1 << 19, 7, 5), (4, 1 << 17, 3, 3)])
def test_known_changes_give_the_same_payload(width, n, every, level):
    new, base = _pair(n, width, every, seed=every)
    signed = {2: np.int16, 4: np.int32}[width]
    want = codec.encode(new, base, width, level=level)
    idx = np.nonzero(new.view(signed) != base.view(signed))[0]
    got = codec.encode(new, base, width, level=level, known=(idx, new.view(signed)[idx]))
    assert (got.codec, got.payload, got.changed) == (want.codec, want.payload, want.changed)
    # a superset: elements that the device saw change against a stale copy, but equal the base here
    extra = np.union1d(idx, np.arange(1, n, 101))
    got = codec.encode(new, base, width, level=level, known=(extra, new.view(signed)[extra]))
    assert (got.codec, got.payload, got.changed) == (want.codec, want.payload, want.changed)
    assert np.array_equal(codec.decode(got.codec, got.payload, base, new.size, width), new)


def test_known_changes_of_another_width_are_ignored():
    new, base = _pair(1 << 18, 2, 50, seed=1)
    want = codec.encode(new, base, 2)
    wrong = (np.arange(4), np.zeros(4, np.int32))  # int32 values for a bf16 chunk: not usable, found again
    assert codec.encode(new, base, 2, known=wrong).payload == want.payload
