"""Catch-up: a reader takes the cheaper of its own chain and the newest full version, by bytes read."""

from __future__ import annotations

import pytest

from deltafs.read.pull import local_version, pull
from deltafs.format.keys import bridge_key
from deltafs.read.chain import MAX_BRIDGES, chain_cost, plan_chain
from deltafs.read.inspect import plan_pull
from deltafs.store.repo import Repository
from deltafs.testing.checkpoints import files_of

from history_helpers import bytes_needed, push_history


@pytest.fixture
def history(tmp_path, maker):
    store = str(tmp_path / "store")
    srcs = push_history(store, maker, 9, keyframe_every=4)  # full 1, 5, 9
    return store, srcs, Repository.open(store)


def _reader_at(tmp_path, store, version, name="dest"):
    dest = tmp_path / name
    pull(store, str(dest), version=version)
    return dest


def test_reader_after_the_last_full_version_replays_its_own_chain(tmp_path, history):
    store, srcs, repo = history
    dest = _reader_at(tmp_path, store, 6)
    res = pull(store, str(dest), version=8)
    assert not res.from_full and res.previous == 6
    assert res.bytes_read == bytes_needed(repo, 8, 6)
    assert res.bytes_read < bytes_needed(repo, 8, None)  # cheaper than starting at full version 5
    assert files_of(dest) == files_of(srcs[8])


def test_reader_before_a_full_version_starts_there_or_crosses_it_by_its_bridge(tmp_path, history):
    store, srcs, repo = history
    dest = _reader_at(tmp_path, store, 2)
    chain = plan_chain(repo, 7, local_version(str(dest)))  # without bridges: no cheaper than starting at 5
    assert chain.local is None and [m.version for m in chain.steps] == [5, 6, 7]
    crossed = plan_chain(repo, 7, local_version(str(dest)), bridges=MAX_BRIDGES)
    assert [m.version for m in crossed.steps] == [3, 4, 5, 6, 7] and "bridge_of" in crossed.steps[2].stats
    res = pull(store, str(dest), version=7)
    assert not res.from_full and res.bytes_read == chain_cost(crossed.steps) < bytes_needed(repo, 7, None)
    assert files_of(dest) == files_of(srcs[7])
    # Without the bridge the chain 2 -> 7 crosses full version 5, so reading from 5 is what it costs; nothing
    # before 5 is read.
    repo.objects.delete(bridge_key(5))
    dest = _reader_at(tmp_path, store, 2, "dest2")
    plan = plan_pull(store, str(dest), version=7)
    res = pull(store, str(dest), version=7)
    assert res.from_full
    # ... less what DEST holds unchanged (config.json), linked instead of read, as the dry run says
    assert res.bytes_read == plan.bytes_to_read < bytes_needed(repo, 7, None) and plan.files_linked
    assert files_of(dest) == files_of(srcs[7])


def test_reader_with_nothing_starts_at_the_newest_full_version_at_or_below_the_target(tmp_path, history):
    store, srcs, repo = history
    for target, full in [(4, 1), (5, 5), (8, 5), (9, 9)]:
        chain = plan_chain(repo, target, None)
        assert chain.steps[0].version == full and chain.steps[0].kind == "full"
        dest = tmp_path / f"new{target}"
        res = pull(store, str(dest), version=target)
        assert res.from_full and res.bytes_read == bytes_needed(repo, target, None)
        assert files_of(dest) == files_of(srcs[target])


def test_reader_going_back_to_an_older_version(tmp_path, history):
    store, srcs, repo = history
    dest = _reader_at(tmp_path, store, 8)
    plan = plan_pull(store, str(dest), version=3)
    res = pull(store, str(dest), version=3)
    assert res.from_full and res.bytes_read == plan.bytes_to_read < bytes_needed(repo, 3, None)  # links config.json
    assert files_of(dest) == files_of(srcs[3])


def test_a_chain_is_never_more_expensive_than_the_full_path(tmp_path, history):
    """Over every (local, target) pair the plan reads min(chain, newest full <= target) bytes."""
    store, srcs, repo = history
    versions = repo.versions()
    for a in versions:
        state = _reader_at(tmp_path, store, a, name=f"r{a}")
        local = local_version(str(state))
        for b in versions:
            if b == a:
                continue
            chain = plan_chain(repo, b, local)
            from_full = bytes_needed(repo, b, None)
            cost = bytes_needed(repo, b, a if chain.local is not None else None)
            assert cost <= from_full
            if chain.local is not None:
                assert a < b and a >= max(v for v in versions if v <= b and repo.manifest(v).kind == "full")
