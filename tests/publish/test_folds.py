"""Folded deltas: a lagging or new reader rebuilds version N from its full version in one step."""

from __future__ import annotations

import json

import pytest

from deltafs.format.manifest import manifest_json, stored_manifest
from deltafs.format.keys import fold_key
from deltafs.read.chain import chain_cost, plan_chain
from deltafs.store.accelerators import load_fold
from deltafs.maintenance.gc import gc
from deltafs.maintenance.verify import verify
from deltafs.publish import push
from deltafs.read.pull import local_version, pull
from deltafs.testing.checkpoints import files_of

from history_helpers import MovingSubset, moving_history


@pytest.fixture
def history(tmp_path):
    return moving_history(tmp_path, 8, fold=True, keyframe_every=5)  # full 1 and 6


def test_folds_are_written_for_deltas_two_or_more_steps_past_a_full_version(history):
    store, _srcs, results, repo = history
    folded = sorted(int(k.split("/v")[1][:10]) for k in repo.objects.list("folds"))
    assert folded == [3, 4, 5, 8]
    assert [v for v, r in results.items() if r.fold_bytes] == folded
    for v in folded:
        fold = load_fold(repo, repo.manifest(v))
        full = 1 if v < 6 else 6
        assert fold is not None and fold.parent == full and fold.parent_digest == repo.manifest(full).digest
        assert fold.stats["fold_of"] == repo.manifest(v).digest


def test_a_new_reader_takes_the_fold_and_installs_the_real_version(tmp_path, history):
    store, srcs, _results, repo = history
    dest = tmp_path / "dest"
    res = pull(store, str(dest), version=4)
    full, fold = repo.manifest(1), load_fold(repo, repo.manifest(4))
    assert res.from_full and not res.fallback
    assert res.bytes_read == chain_cost([full, fold]) < chain_cost(plan_chain(repo, 4, None).steps)
    assert files_of(dest) == files_of(srcs[4])
    state = local_version(str(dest))
    assert state.version == 4 and state.digest == repo.manifest(4).digest  # N's own manifest, not the fold's
    assert verify(store, local=str(dest)).ok
    # From there the reader follows the ordinary chain.
    res = pull(store, str(dest), version=5)
    assert not res.from_full and res.previous == 4 and files_of(dest) == files_of(srcs[5])


def test_a_reader_with_a_local_base_keeps_its_chain(tmp_path, history):
    store, srcs, _results, repo = history
    dest = tmp_path / "dest"
    pull(store, str(dest), version=2)
    plan = plan_chain(repo, 5, local_version(str(dest)), folds=True)
    assert plan.final is None and [m.version for m in plan.steps] == [3, 4, 5]
    res = pull(store, str(dest), version=5)
    assert not res.from_full and res.bytes_read == chain_cost(plan.steps)
    assert files_of(dest) == files_of(srcs[5])


def test_a_damaged_or_foreign_fold_is_not_trusted(tmp_path, history):
    store, srcs, _results, repo = history
    fold = load_fold(repo, repo.manifest(4))
    # A chunk of the fold is gone: the pull falls back to the ordinary chain and still succeeds.
    victim = next(ch.object for f in fold.files for s in f.segments for ch in s.chunks
                  if ch.object and ch.name in ("xor", "sparse"))
    repo.objects.delete(f"chunks/{victim[:2]}/{victim}")
    res = pull(store, str(tmp_path / "d4"), version=4)
    assert res.fallback and files_of(tmp_path / "d4") == files_of(srcs[4])
    # A fold that names another version's digest is ignored.
    raw = json.loads(manifest_json(repo.objects.get(fold_key(5))))
    raw["stats"]["fold_of"] = repo.manifest(4).digest
    repo.objects.put(fold_key(5), stored_manifest(json.dumps(raw).encode()))
    assert load_fold(repo, repo.manifest(5)) is None
    res = pull(store, str(tmp_path / "d5"), version=5)
    assert res.bytes_read == chain_cost(plan_chain(repo, 5, None).steps)
    assert files_of(tmp_path / "d5") == files_of(srcs[5])
    assert verify(store, all_versions=True).ok  # verify checks the ordinary chains


def test_show_diff_and_open_version_read_past_a_damaged_fold(tmp_path, history):
    """An object only the fold of version 4 names, deleted: pull and verify were fine, but `deltafs diff 3 4` exited
    6 and open_version(4).tensor_bytes() raised ChunkNotFoundError. They read the version by its own chain now."""
    from deltafs.maintenance.inspect import diff
    from deltafs.read.inspect import open_version
    from deltafs.testing.checkpoints import run_cli
    from safetensors.numpy import load_file

    store, srcs, _results, repo = history
    fold, own = load_fold(repo, repo.manifest(4)), plan_chain(repo, 4, None).steps
    theirs = {ch.object for m in own for f in m.files for s in f.segments for ch in s.chunks if ch.object}
    victim = next(ch.object for f in fold.files for s in f.segments for ch in s.chunks
                  if ch.object and ch.object not in theirs)
    repo.objects.delete(f"chunks/{victim[:2]}/{victim}")
    expected = load_file(str(srcs[4] / "model.safetensors"))
    reader = open_version(store, 4)
    for name, value in expected.items():
        assert reader.tensor_bytes(name) == value.tobytes()
    assert any(d.changed for d in diff(store, 3, 4))
    proc = run_cli("diff", store, "3", "4")
    assert proc.returncode == 0, proc.stderr


def test_gc_removes_folds_of_removed_versions_and_keeps_what_kept_folds_need(tmp_path, history):
    store, srcs, _results, repo = history
    res = gc(store, keep_last=2, grace=0, settle=0)  # keeps 7, 8 and their chain from full 6
    assert sorted(res.plan.keep) == [6, 7, 8] and sorted(res.plan.folds) == [3, 4, 5]
    assert repo.objects.list("folds") == [fold_key(8)]
    assert verify(store, all_versions=True).ok
    out = pull(store, str(tmp_path / "d"), version=8)
    assert out.bytes_read == chain_cost([repo.manifest(6), load_fold(repo, repo.manifest(8))])
    assert files_of(tmp_path / "d") == files_of(srcs[8])


def test_a_restarted_trainer_rebuilds_its_keyframe_cache_from_the_store(tmp_path):
    store = str(tmp_path / "store")
    gen = MovingSubset(tmp_path / "src")
    push(store, gen.write(), fold=True, cache_dir=str(tmp_path / "c1"))
    push(store, gen.write(), fold=True, cache_dir=str(tmp_path / "c1"))
    res = push(store, gen.write(), fold=True, cache_dir=str(tmp_path / "c2"))  # new host, no keyframe cache
    assert res.version == 3 and res.base_rederived and res.fold_bytes > 0
    src3 = gen.root / "step2"
    pull(store, str(tmp_path / "d"))
    assert files_of(tmp_path / "d") == files_of(src3)


def test_a_gc_while_the_fold_is_written_keeps_the_folds_new_chunks(tmp_path, maker, monkeypatch):
    """`push --fold` let its in-flight marker go at the commit, before it wrote the fold: a gc (grace 0) meanwhile
    removed the fold's new chunks, and the fold was written naming missing objects; every new host then fell back to
    the full chain (adversarial pass). The marker stays until the fold is written."""
    from deltafs.format.manifest import referenced_objects
    from deltafs.publish import fold as fold_module
    from deltafs.store.repo import Repository

    store = str(tmp_path / "store")
    cache = str(tmp_path / "cache")
    for _ in range(2):
        push(store, maker.write(), cache_dir=cache)
        maker.advance()
    real = fold_module.ensure_chunks
    ran: list[object] = []

    def gc_meanwhile(repo, files, stats, **kw):  # the fold's chunks are written; its file is not yet
        ran.append(gc(store, keep_last=100, grace=0, settle=0))
        return real(repo, files, stats, **kw)

    monkeypatch.setattr(fold_module, "ensure_chunks", gc_meanwhile)
    res = push(store, maker.write(), cache_dir=cache, fold=True)
    assert ran and res.version == 3 and res.fold_bytes > 0
    repo = Repository.open(store)
    fold = load_fold(repo, repo.manifest(3))
    assert fold is not None
    missing = [o for o in referenced_objects(fold.files) if not repo.has_chunk(o)]
    assert not missing
    dest = tmp_path / "dest"
    pulled = pull(store, str(dest))
    assert pulled.from_full and not pulled.fallback


def test_a_fold_part_whose_ranks_marker_lapsed_has_every_chunk_checked(tmp_path, maker, monkeypatch):
    """push_distributed: each rank writes its fold chunks under its own marker, and the root checked only by its own
    marker's state: a rank frozen while it encoded (its marker lapsed, a gc removed its new chunks) made a fold that
    names missing objects (review). A part says whether its rank's marker lapsed."""
    import dataclasses

    from deltafs.format.manifest import referenced_objects
    from deltafs.publish import fold as fold_module
    from deltafs.publish import pipeline
    from deltafs.store.repo import Repository

    store = str(tmp_path / "store")
    cache = str(tmp_path / "cache")
    for _ in range(2):
        push(store, maker.write(), cache_dir=cache)
        maker.advance()
    before = set(referenced_objects(f for v in (1, 2) for f in Repository.open(store).manifest(v).files))
    real = fold_module.write_fold

    def a_rank_lapsed(repo, man, parts, guard=None):
        new = sorted(set(referenced_objects(fold_module.FileEntry.from_json(f) for p in parts for f in p.files)) - before)
        repo.objects.delete(f"chunks/{new[0][:2]}/{new[0]}")  # what a gc did while that rank's marker had lapsed
        return real(repo, man, [dataclasses.replace(p, lapsed=True) for p in parts], None)  # the root's is fine

    monkeypatch.setattr(pipeline, "write_fold", a_rank_lapsed)
    res = push(store, maker.write(), cache_dir=cache, fold=True)
    assert res.version == 3
    repo = Repository.open(store)
    fold = load_fold(repo, repo.manifest(3))
    assert fold is None and res.fold_bytes == 0  # every chunk checked: the missing one failed the fold, not named
