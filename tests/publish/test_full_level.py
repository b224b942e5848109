"""The zstd level of chunks stored whole (full versions, new tensors) is its own option, apart from the deltas'."""

from __future__ import annotations

import numpy as np
import pytest

from deltafs import codec
from deltafs.errors import UsageError
from deltafs.publish import PushOptions, push
from deltafs.read.pull import pull
from deltafs.store.repo import Repository
from deltafs.testing.checkpoints import files_of

from history_helpers import MovingSubset


def _raw_payloads(repo: Repository, version: int) -> dict[str, int]:
    return {s.key: sum(c.stored for c in s.chunks) for f in repo.manifest(version).files for s in f.segments
            if s.chunks and s.chunks[0].name == "raw"}


def test_full_level_sets_the_whole_chunks_and_leaves_the_deltas_alone(tmp_path):
    gen = MovingSubset(tmp_path / "src")
    v1, v2 = gen.write(), gen.write()
    stores = {}
    for lvl in (1, 19):
        store = str(tmp_path / f"store{lvl}")
        push(store, v1, full_level=lvl, cache_dir=str(tmp_path / f"cache{lvl}"))
        push(store, v2, full_level=lvl, cache_dir=str(tmp_path / f"cache{lvl}"))
        stores[lvl] = Repository.open(store)
        dest = tmp_path / f"dest{lvl}"
        pull(store, str(dest), version=1)
        assert files_of(dest) == files_of(v1)
        pull(store, str(dest), version=2)
        assert files_of(dest) == files_of(v2)
    full1, full19 = _raw_payloads(stores[1], 1), _raw_payloads(stores[19], 1)
    assert full1.keys() == full19.keys() and full1 != full19  # the full version's chunks follow full_level
    # The delta's chunks follow --level only: the same payloads whatever full_level is.
    delta = [[(c.name, c.stored) for f in r.manifest(2).files for s in f.segments for c in s.chunks]
             for r in (stores[1], stores[19])]
    assert delta[0] == delta[1]


def test_codec_full_level_only_applies_without_a_base():
    rng = np.random.default_rng(3)
    new = rng.standard_normal(50_000).astype(np.float32)
    base = new.copy()
    base[::97] += 1e-3
    whole1, whole19 = (codec.encode(new.view(np.uint8), None, 4, level=3, full_level=lvl) for lvl in (1, 19))
    assert whole1.codec["name"] == "raw" and whole1.payload != whole19.payload
    assert whole1.payload == codec.encode(new.view(np.uint8), None, 4, level=1).payload
    d1, d19 = (codec.encode(new.view(np.uint8), base.view(np.uint8), 4, level=3, full_level=lvl) for lvl in (1, 19))
    assert d1.codec == d19.codec and d1.payload == d19.payload


@pytest.mark.parametrize("kw", [{"full_level": 0}, {"full_level": 23}, {"level": 0}, {"full_level": True}, {"level": 2.5}])
def test_levels_outside_zstd_range_are_refused(kw):
    with pytest.raises(UsageError):
        PushOptions(**kw)
