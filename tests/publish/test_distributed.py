"""Multi-rank push over gloo: ranks write their own shards in parallel, one commit, all-or-nothing."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket

import pytest
import torch
from safetensors.torch import load_file

from deltafs.publish.distributed import push_distributed, shard_name
from deltafs.errors import UsageError
from deltafs.maintenance.gc import gc
from deltafs.maintenance.verify import verify
from deltafs.read.pull import pull
from deltafs.store.repo import Repository

from . import dist_workers
from .dist_workers import CONFIG, model_at


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(tmp_path, world: int, scenario: str, **args) -> list[dict]:
    """Start `world` spawned processes running one scenario; return each rank's report (None if it died)."""
    out = tmp_path / f"out-{scenario}-{_free_port()}"
    out.mkdir()
    args.setdefault("cache", str(tmp_path / "caches"))
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=dist_workers.run, args=(r, world, port, str(out), scenario, args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
        if p.is_alive():
            p.kill()
            p.join()
    reports = []
    for r in range(world):
        path = out / f"rank{r}.json"
        reports.append(json.loads(path.read_text()) if path.exists() else None)
    return reports


def load_pulled(dest) -> dict[str, torch.Tensor]:
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    tensors = {}
    for fname in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(dest / fname)))
    assert set(tensors) == set(index["weight_map"])
    return tensors


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name].view(torch.int16), want[name].view(torch.int16)), name


def test_three_ranks_push_deltas_that_pull_back_exactly(tmp_path):
    store = str(tmp_path / "store")
    reports = run_ranks(tmp_path, 3, "push_steps", store=store, steps=[0, 1, 2])
    assert all(r and r["ok"] for r in reports), reports
    # Every rank returns the same result; the second and third pushes are deltas from the rank caches.
    per_rank = [[(x["version"], x["kind"], x["bytes_written"]) for x in r["results"]] for r in reports]
    assert per_rank[0] == per_rank[1] == per_rank[2]
    assert [k for _, k, _ in per_rank[0]] == ["full", "delta", "delta"]
    assert not any(x["base_rederived"] for x in reports[0]["results"][1:])
    full_size, delta_size = per_rank[0][0][2], per_rank[0][1][2]
    assert delta_size * 3 < full_size
    repo = Repository.open(store)
    man = repo.manifest(3)
    assert sorted(f.path for f in man.files) == sorted(
        [shard_name(r, 3) for r in range(3)] + ["config.json", "model.safetensors.index.json", "tokenizer/tokenizer.json"])
    assert man.metadata == {"step": 2} and man.stats["ranks"] == 3
    # Each shard holds exactly its rank's tensors.
    dest = tmp_path / "dest"
    for version, step in [(1, 0), (2, 1), (3, 2)]:
        pull(store, str(dest), version=version)
        assert_same(load_pulled(dest), model_at(step))
        assert (dest / "config.json").read_bytes() == CONFIG
    names = list(model_at(0))
    assert set(load_file(str(dest / shard_name(1, 3)))) == {n for i, n in enumerate(names) if i % 3 == 1}
    assert verify(store, all_versions=True).ok


def test_new_world_size_rederives_each_ranks_base_from_the_store(tmp_path):
    store = str(tmp_path / "store")
    assert all(r["ok"] for r in run_ranks(tmp_path, 2, "push_steps", store=store, steps=[0, 1]))
    # Restarted job on 3 ranks with fresh caches: a delta against version 2, bases rebuilt from the store.
    reports = run_ranks(tmp_path, 3, "push_steps", store=store, steps=[2], cache=str(tmp_path / "other-caches"))
    assert all(r and r["ok"] for r in reports), reports
    res = reports[0]["results"][0]
    assert res["version"] == 3 and res["kind"] == "delta" and res["base_rederived"]
    assert Repository.open(store).manifest(3).parent == 2
    pull(store, str(tmp_path / "dest"))
    assert_same(load_pulled(tmp_path / "dest"), model_at(2))
    assert verify(store, all_versions=True).ok


def test_a_tensor_owned_by_two_ranks_is_refused_before_anything_is_written(tmp_path):
    store = tmp_path / "store"
    reports = run_ranks(tmp_path, 2, "duplicate_owner", store=str(store))
    for r in reports:
        assert not r["ok"] and r["error"] == "UsageError", r
        assert "model.embed_tokens.weight is owned by ranks 0 and 1" in r["message"]
        assert "shapes disagree (BF16[96, 32] vs BF16[95, 32])" in r["message"]
    assert not store.exists()  # not even the store was created


def test_an_extra_safetensors_file_repeating_a_pushed_tensor_is_refused_before_anything_is_written(tmp_path):
    """Rank 1's extra.safetensors held a tensor rank 0 pushes: every chunk was encoded and uploaded, then the
    commit failed on a duplicate segment (adversarial pass). Refused in the layout check, on every rank."""
    store = tmp_path / "store"
    reports = run_ranks(tmp_path, 2, "extra_file_repeats_a_tensor", store=str(store))
    for r in reports:
        assert r is not None and not r["ok"] and r["error"] == "UsageError", r
        assert "of extra file extra.safetensors (rank 1) is also pushed by rank 0" in r["message"]
    assert not store.exists()


def test_a_rank_that_fails_while_writing_aborts_the_version_everywhere(tmp_path):
    store = str(tmp_path / "store")
    reports = run_ranks(tmp_path, 3, "fail_then_succeed", store=store)
    assert all(r and r["ok"] for r in reports), reports
    assert reports[1]["failed"]["error"] == "LocalWriteError"  # its cache cannot be made under a file: exit 12
    for r in (reports[0], reports[2]):
        assert r["failed"]["error"] == "DistributedPushError", r
        assert "rank 1 failed" in r["failed"]["message"] and "not committed" in r["failed"]["message"]
    assert all(r["versions_after_failure"] == [1] for r in reports)
    assert reports[0]["again"]["version"] == 2 and reports[0]["again"]["kind"] == "delta"
    pull(store, str(tmp_path / "dest"))
    assert_same(load_pulled(tmp_path / "dest"), model_at(1))
    assert verify(store, all_versions=True).ok


def test_a_rank_killed_mid_push_leaves_no_version_and_the_next_push_succeeds(tmp_path):
    store = str(tmp_path / "store")
    push_distributed(store, model_at(0))  # version 1, from a single process
    reports = run_ranks(tmp_path, 3, "die_while_writing", store=store, step=1, timeout=90)
    assert reports[1] is None  # SIGKILLed before it could report
    for r in (reports[0], reports[2]):
        assert r is not None and r["error"] == "DistributedPushError", r  # the survivors notice and give up
        assert "process group failed" in r["message"] and "not committed" in r["message"]
    repo = Repository.open(store)
    assert repo.versions() == [1] and repo.head().version == 1
    assert len(list(repo.objects.list("chunks"))) > len(gc(store, keep_last=1, grace=0, dry_run=True).plan.chunks) > 0
    assert verify(store, all_versions=True).ok
    # The same job restarted: succeeds, and the dead push's chunks are garbage that gc removes.
    reports = run_ranks(tmp_path, 3, "push_steps", store=store, steps=[1])
    assert all(r and r["ok"] for r in reports), reports
    assert reports[0]["results"][0]["version"] == 2
    pull(store, str(tmp_path / "dest"))
    assert_same(load_pulled(tmp_path / "dest"), model_at(1))
    gc(store, keep_last=2, grace=0, settle=0)
    assert verify(store, all_versions=True).ok


def test_a_group_broken_while_the_root_commits_never_says_not_committed(tmp_path):
    """A rank died while the root committed: every survivor said "version not committed" although version 2 was
    HEAD, and a trainer believing it would push the step twice (adversarial pass). The root now says it committed;
    a rank that could not hear the outcome says it may have been committed."""
    store = str(tmp_path / "store")
    push_distributed(store, model_at(0))
    reports = run_ranks(tmp_path, 3, "die_while_the_root_commits", store=store, step=1, timeout=30)
    assert reports[1] is None
    repo = Repository.open(store)
    assert repo.head().version == 2  # the root did commit
    root = reports[0]
    assert root is not None and root["error"] == "DistributedPushError", root
    assert "this rank (the root) committed the version" in root["message"]
    other = reports[2]
    assert other is not None and (other["ok"] or "may have been committed" in other["message"]), other
    for r in (root, other):
        assert "not committed" not in r.get("message", "")
    pull(store, str(tmp_path / "dest"))
    assert_same(load_pulled(tmp_path / "dest"), model_at(1))


def test_a_rank_failing_on_its_own_fails_the_step_everywhere_and_the_next_step_is_whole(tmp_path):
    """Rank 1 alone passed a bad option at step 1 and raised before the first collective; the others waited there,
    its step-2 call met their step-1 call, and version 2 was committed with two layers of step 2 and the rest of
    step 1, labelled step 1 (adversarial pass). Every local check now runs inside the first collective."""
    store = str(tmp_path / "store")
    reports = run_ranks(tmp_path, 3, "local_error_then_continue", store=store, timeout=60)
    for r in reports:
        assert r is not None and r["ok"], r
        first, second = r["steps"]
        assert "error" in first and "threads" in first["message"], first
        assert second["result"]["version"] == 2 and second["result"]["metadata"] == {"step": 2}, second
    assert Repository.open(store).versions() == [1, 2]
    pull(store, str(tmp_path / "dest"))
    assert_same(load_pulled(tmp_path / "dest"), model_at(2))


def test_ranks_naming_different_roots_are_refused_at_once(tmp_path):
    """They waited for the process group's timeout (30 minutes by default) with "a rank died or hung?"."""
    import time

    store = str(tmp_path / "store")
    t0 = time.monotonic()
    reports = run_ranks(tmp_path, 2, "disagree_on_root", store=store, timeout=120)
    assert time.monotonic() - t0 < 100
    for r in reports:
        assert r is not None and r["error"] == "UsageError" and "names root" in r["message"], r
    assert not os.path.exists(os.path.join(store, "manifests"))


def test_with_metadata_from_another_step_on_one_rank_nothing_is_written():
    from deltafs.publish.distributed import _Call, _check_same_call

    _check_same_call([_Call(0, None, {"step": 3}), _Call(0, None, {}), _Call(0, None, {"step": 3})])
    with pytest.raises(UsageError, match="rank 2 gives step 4, the root .rank 0. 3"):
        _check_same_call([_Call(0, None, {"step": 3}), _Call(0, None, {}), _Call(0, None, {"step": 4})])
    with pytest.raises(UsageError, match="rank 1 pushes version 7"):
        _check_same_call([_Call(0, 6, {}), _Call(0, 7, {})])
    _check_same_call([_Call(1, None, {}), _Call(1, 9, {"a": 1})])  # the root (rank 1) gives both


def test_a_rank_given_a_copy_of_the_store_fails_the_push_everywhere(tmp_path):
    """A copy of the store (same store id at another path) passed the store-id check at open: the root committed a
    version whose other chunks were only in the copy, pull exit 6 (adversarial pass). The root now finds each
    rank's in-flight marker in its own store before it commits."""
    store = str(tmp_path / "store")
    reports = run_ranks(tmp_path, 3, "rank_on_a_store_copy", store=store, timeout=60)
    for r in reports:
        assert r is not None and r["ok"], r
        assert "did not write to the store the root commits to" in r["failed"]["message"], r["failed"]
        assert r["again"]["version"] == 2
    assert Repository.open(store).versions() == [1, 2]
    assert verify(store, all_versions=True).ok
    pull(store, str(tmp_path / "dest"))
    assert_same(load_pulled(tmp_path / "dest"), model_at(1))


def test_without_a_process_group_it_is_a_world_of_one(tmp_path, monkeypatch):
    store = str(tmp_path / "store")
    res = push_distributed(store, model_at(0), extra_files={"config.json": CONFIG})
    assert res.version == 1 and res.kind == "full"
    res = push_distributed(store, model_at(1), extra_files={"config.json": CONFIG})
    assert res.kind == "delta" and not res.base_rederived
    pull(store, str(tmp_path / "dest"))
    assert sorted(os.listdir(tmp_path / "dest")) == ["config.json", "model-00001-of-00001.safetensors",
                                                      "model.safetensors.index.json"]
    assert_same(load_pulled(tmp_path / "dest"), model_at(1))
    with pytest.raises(UsageError, match="not a torch.Tensor"):
        push_distributed(store, {"x": [1, 2]})
    with pytest.raises(UsageError, match="clashes"):
        push_distributed(store, model_at(1), extra_files={"model.safetensors.index.json": b"{}"})


def test_ranks_push_an_fsdp2_dtensor_state_dict_and_fold(tmp_path):
    """DTensors with the same names on every rank are gathered and written once; a multi-rank push folds too."""
    store = str(tmp_path / "store")
    reports = run_ranks(tmp_path, 2, "dtensor_state_dict", store=store, steps=[0, 1, 2])
    assert all(r and r["ok"] for r in reports), reports
    results = reports[0]["results"]
    assert [res["kind"] for res in results] == ["full", "delta", "delta"]
    assert results[2]["fold_bytes"] > 0  # v3 is two deltas past v1: folded
    same = [{k: v for k, v in r.items() if k != "seconds"} for r in results]
    assert same == [{k: v for k, v in r.items() if k != "seconds"} for r in reports[1]["results"]]
    from deltafs.format.keys import fold_key

    assert Repository.open(store).objects.exists(fold_key(3))
    pull(store, str(tmp_path / "dest"))
    assert_same(load_pulled(tmp_path / "dest"), model_at(2))
    assert verify(store, all_versions=True).ok


def test_ranks_write_a_keyframes_bridge_that_a_host_at_the_parent_crosses(tmp_path):
    store = str(tmp_path / "store")
    reports = run_ranks(tmp_path, 2, "push_steps", store=store, steps=[0, 1, 2], push_kwargs={"keyframe_every": 2})
    assert all(r and r["ok"] for r in reports), reports
    results = reports[0]["results"]
    assert [x["kind"] for x in results] == ["full", "delta", "full"]
    assert [x["bridge_bytes"] for x in results] == [x["bridge_bytes"] for x in reports[1]["results"]]
    assert results[0]["bridge_bytes"] == 0 and 0 < results[2]["bridge_bytes"] < results[2]["bytes_written"] / 3
    dest = tmp_path / "dest"
    pull(store, str(dest), version=2)
    res = pull(store, str(dest), version=3)
    assert not res.from_full and res.bytes_read < results[2]["bytes_written"] / 3
    assert_same(load_pulled(dest), model_at(2))
    assert verify(store, local=str(dest)).ok


def test_a_rank_whose_files_cannot_be_made_fails_every_rank_at_once(tmp_path):
    """Rank 1 failed (SourceError) after the ownership check; rank 0 waited for it until the process group's timeout
    (30 minutes by default) and then got gloo's "Timed out waiting" (adversarial pass)."""
    store = tmp_path / "store"
    reports = run_ranks(tmp_path, 2, "bad_file_on_one_rank", store=str(store), timeout=60)
    assert all(r and r["ok"] for r in reports), reports
    assert reports[1]["error"] == "SourceError" and "extra.safetensors" in reports[1]["message"]
    assert reports[0]["error"] == "DistributedPushError" and "rank 1 failed" in reports[0]["message"], reports[0]
    assert all(r["seconds"] < 30 for r in reports), reports
    assert not (store / "manifests").exists()


def test_a_root_that_is_no_rank_is_refused_in_words_that_say_so(tmp_path):
    """root=np.int64(0) was "root rank np.int64(0) is not in a group of 1 ranks", which reads as out of range."""
    import numpy as np

    store = str(tmp_path / "store")
    with pytest.raises(UsageError, match="root must be an int"):
        push_distributed(store, model_at(0), root=0.0)
    with pytest.raises(UsageError, match="root must be an int"):
        push_distributed(store, model_at(0), root=True)
    with pytest.raises(UsageError, match="root rank 3 is not in a group of 1 ranks"):
        push_distributed(store, model_at(0), root=3)
    assert push_distributed(store, model_at(0), root=np.int64(0)).version == 1  # numpy's integers are ranks too


def test_the_root_decides_whether_every_rank_folds(tmp_path):
    """fold= was each rank's own: a root that folded entered two collectives the other ranks skipped, so their next
    push met the root's fold. Without a metadata step a version was committed of rank 0's step 1 and rank 1's step
    2 (verify passed, pulls served it); with one, every later push failed. fold is now the root's, as full is."""
    store = str(tmp_path / "store")
    reports = run_ranks(tmp_path, 2, "fold_on_the_root_only", store=store, steps=[0, 1, 2, 3], timeout=120)
    assert all(r and r["ok"] for r in reports), reports
    assert [res["version"] for res in reports[1]["results"]] == [1, 2, 3, 4]
    assert [res["fold_bytes"] > 0 for res in reports[0]["results"]] == [False, False, True, True]
    for version, step in ((2, 1), (3, 2), (4, 3)):
        dest = tmp_path / f"dest{version}"
        pull(store, str(dest), version=version)
        assert_same(load_pulled(dest), model_at(step))
    assert verify(store, all_versions=True).ok


def test_ranks_out_of_step_fail_instead_of_taking_another_collective_s_payload():
    """Each collective carries the pipeline step it belongs to: a rank that meets another step's collective raises
    (it took that payload for its own before)."""
    from deltafs.publish.pipeline import DistributedPushError, collective, from_root

    class Skewed:
        rank, world, is_root = 1, 2, False

        def all_gather(self, obj):
            return [("folding", None), obj]

        def broadcast(self, obj):
            return ("folding", None)

    with pytest.raises(DistributedPushError, match="out of step: rank 0 is 'folding', rank 1 .this one. 'checking"):
        collective(Skewed(), "checking the call", lambda: 1)
    with pytest.raises(DistributedPushError, match="out of step: the root is 'folding'"):
        from_root(Skewed(), "reading the store", lambda: 1)


def test_on_every_rank_takes_labels_of_each_rank_and_a_bad_baseline_fails_every_rank(tmp_path):
    """on_every_rank's label became the collective's step tag, so labels naming the rank failed as "out of step";
    a device_baseline that is no DeviceBaseline was refused on its rank alone, outside the first collective, and the
    other ranks waited for the process group's timeout."""
    store = str(tmp_path / "store")
    reports = run_ranks(tmp_path, 2, "own_labels_and_a_bad_baseline", store=store, timeout=60)
    assert all(r and r["ok"] for r in reports), reports
    assert [r["got"] for r in reports] == [0, 10]
    for r in reports:
        assert "device_baseline must be a deltafs.DeviceBaseline" in r["refused"]["message"], r["refused"]
        assert r["again"]["version"] == 1
