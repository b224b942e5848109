"""Keyframe bridges: a host that holds a full version's parent applies one delta instead of reading it whole."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import replace

import jsonschema
import numpy as np
import pytest

from deltafs.format.keys import bridge_key
from deltafs.maintenance.gc import gc
from deltafs.maintenance.log import log
from deltafs.maintenance.verify import verify
from deltafs.publish import push, push_tensors
from deltafs.publish import pipeline
from deltafs.read.chain import MAX_BRIDGES, chain_cost, plan_chain
from deltafs.store.accelerators import load_bridge
from deltafs.read.inspect import plan_pull
from deltafs.read.pull import local_version, pull
from deltafs.store.repo import Repository
from deltafs.testing.checkpoints import files_of, run_cli

from history_helpers import MovingSubset, moving_history

with open(os.path.join(os.path.dirname(__file__), "..", "..", "manifests", "manifest.schema.json")) as _fh:
    SCHEMA = json.load(_fh)


@pytest.fixture
def history(tmp_path):
    """Eight versions, full at 1, 4 and 7 (keyframe_every=3); 4 and 7 have bridges."""
    return moving_history(tmp_path, 8, keyframe_every=3)


def _pull_at(store, dest, version):
    pull(store, str(dest), version=version)
    return dest


def test_every_full_version_with_a_parent_gets_its_bridge(history):
    _store, _srcs, results, repo = history
    assert [v for v in repo.versions() if repo.manifest(v).kind == "full"] == [1, 4, 7]
    assert sorted(int(k.split("/v")[1][:10]) for k in repo.objects.list("bridges")) == [4, 7]
    assert [v for v, r in results.items() if r.bridge_bytes] == [4, 7]
    for v in (4, 7):
        full, bridge = repo.manifest(v), load_bridge(repo, repo.manifest(v))
        assert bridge is not None and bridge.kind == "delta" and bridge.version == v
        assert (bridge.parent, bridge.parent_digest) == (v - 1, repo.manifest(v - 1).digest) == (full.parent, full.parent_digest)
        assert bridge.stats["bridge_of"] == full.digest
        jsonschema.validate(json.loads(bridge.to_bytes()), SCHEMA)  # the same manifest format
        # A bridge costs a delta's bytes, a small part of the full version it stands in for.
        assert results[v].bridge_bytes < results[v].bytes_written / 10
        assert results[v].bridge_bytes < 2 * results[v - 1].bytes_written


def test_a_host_at_the_parent_crosses_the_keyframe_by_its_bridge(tmp_path, history):
    store, srcs, _results, repo = history
    dest = _pull_at(store, tmp_path / "dest", 3)
    chain = plan_chain(repo, 4, local_version(str(dest)), bridges=MAX_BRIDGES)
    assert [m.version for m in chain.steps] == [4] and chain.steps[0].stats["bridge_of"] == repo.manifest(4).digest
    res = pull(store, str(dest), version=4)
    assert not res.from_full and not res.fallback and res.previous == 3
    assert res.bytes_read == chain_cost(chain.steps) < chain_cost([repo.manifest(4)]) / 10
    assert files_of(dest) == files_of(srcs[4])
    state = local_version(str(dest))
    assert state.version == 4 and state.digest == repo.manifest(4).digest  # the version's own manifest
    assert verify(store, local=str(dest)).ok
    res = pull(store, str(dest), version=5)  # and the ordinary chain from there
    assert not res.from_full and files_of(dest) == files_of(srcs[5])


def test_a_lagging_host_crosses_two_keyframes_when_that_reads_less(tmp_path, history):
    store, srcs, _results, repo = history
    dest = _pull_at(store, tmp_path / "dest", 2)
    plan = plan_pull(store, str(dest), version=8)
    assert [(s["version"], s["bridge"]) for s in plan.steps] == [
        (3, False), (4, True), (5, False), (6, False), (7, True), (8, False)]
    res = pull(store, str(dest), version=8)
    assert not res.from_full and res.bytes_read == plan.bytes_to_read
    assert res.bytes_read < chain_cost(plan_chain(repo, 8, None).steps)
    assert files_of(dest) == files_of(srcs[8])
    # One crossing allowed: the host starts from the full version 7 instead.
    two_back = plan_chain(repo, 8, local_version(str(_pull_at(store, tmp_path / "d2", 2))), bridges=1)
    assert two_back.local is None and two_back.steps[0].version == 7


def test_the_cli_dry_run_names_the_bridge(tmp_path, history):
    store, _srcs, _results, _repo = history
    dest = _pull_at(store, tmp_path / "dest", 6)
    out = run_cli("pull", store, str(dest), "--version", "8", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "apply 7 (bridge) -> 8" in out.stdout


def test_log_shows_each_usable_bridge(history):
    """`deltafs log` names the bridge of each full version that has one (its chunks plus its manifest, what a
    host at the parent reads), in --json and in text; a full version without a parent has none, and a bridge
    that does not belong to its version is not shown."""
    store, _srcs, results, repo = history
    entries = {e.version: e for e in log(store)}
    assert [v for v, e in entries.items() if e.bridge_bytes is not None] == [4, 7]
    for v in (4, 7):
        assert entries[v].kind == "full"
        assert entries[v].bridge_bytes == results[v].bridge_bytes == (
            load_bridge(repo, repo.manifest(v)).stats["chunk_bytes_stored"] + repo.objects.size(bridge_key(v)))
    out = run_cli("log", store, "--json")
    assert out.returncode == 0, out.stderr
    assert [e["bridge_bytes"] for e in json.loads(out.stdout)["versions"]] == [
        entries[v].bridge_bytes for v in sorted(entries)]
    text = run_cli("log", store).stdout.splitlines()
    assert [line.split()[0] for line in text if " bridge " in line] == ["4", "7"]
    foreign = replace(load_bridge(repo, repo.manifest(7)), parent_digest="sha256:" + "0" * 64).sealed()
    repo.objects.put(bridge_key(7), foreign.encode())
    assert [e.version for e in log(store) if e.bridge_bytes is not None] == [4]


def test_log_reads_each_manifest_and_bridge_once(history):
    """On an object store every request is a round trip: log gets each manifest shown and the bridge of each full
    version shown, and sizes them from those reads (no stat of either)."""
    store, _srcs, _results, repo = history
    calls: list[tuple[str, str]] = []

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            attr = getattr(self.inner, name)
            if not callable(attr):
                return attr

            def counted(*args, **kwargs):
                calls.append((name, args[0] if args else ""))
                return attr(*args, **kwargs)
            return counted

    fresh = Repository.open(store)
    entries = log(Repository(Counting(fresh.objects), fresh.config))
    assert [e.bridge_bytes for e in entries] == [e.bridge_bytes for e in log(store)]
    assert [e.bytes_written for e in entries] == [e.bytes_written for e in log(store)]
    assert sorted(key for op, key in calls if op == "get") == sorted(
        ["HEAD"] + [f"manifests/v{v:010d}.json" for v in range(1, 9)] + [bridge_key(4), bridge_key(7)])
    assert [op for op, _ in calls if op not in ("get", "list")] == []


def test_new_hosts_and_hosts_of_another_chain_start_from_the_full_version(tmp_path, history):
    store, srcs, _results, repo = history
    res = pull(store, str(tmp_path / "new"), version=5)
    assert res.from_full and files_of(tmp_path / "new") == files_of(srcs[5])
    # A bridge made against another version 3 (another digest) is never applied to this one.
    dest = _pull_at(store, tmp_path / "dest", 3)
    foreign = replace(load_bridge(repo, repo.manifest(4)), parent_digest="sha256:" + "0" * 64).sealed()
    repo.objects.put(bridge_key(4), foreign.encode())
    assert load_bridge(repo, repo.manifest(4)) is None
    assert plan_chain(repo, 4, local_version(str(dest)), bridges=MAX_BRIDGES).local is None
    res = pull(store, str(dest), version=4)
    assert res.from_full and not res.fallback and files_of(dest) == files_of(srcs[4])


def test_a_damaged_bridge_falls_back_to_the_full_version(tmp_path, history, caplog):
    store, srcs, _results, repo = history
    # 1: a chunk of the bridge flipped in the store: the pull notices, and rebuilds from the full version.
    dest = _pull_at(store, tmp_path / "dest", 3)
    bridge = load_bridge(repo, repo.manifest(4))
    oid = next(ch.object for f in bridge.files for s in f.segments for ch in s.chunks
               if ch.object is not None and ch.object not in {c.object for f2 in repo.manifest(4).files
                                                              for s2 in f2.segments for c in s2.chunks})
    path = tmp_path / "store" / "chunks" / oid[:2] / oid
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    res = pull(store, str(dest), version=4)
    assert res.fallback and res.from_full and files_of(dest) == files_of(srcs[4])
    # 2: garbage where the bridge manifest was: ignored with a warning, the full version is read.
    dest2 = _pull_at(store, tmp_path / "dest2", 6)
    repo.objects.put(bridge_key(7), b"\x28\xb5\x2f\xfd not a frame")
    with caplog.at_level(logging.WARNING, logger="deltafs"):
        res = pull(store, str(dest2), version=7)
    assert res.from_full and not res.fallback and files_of(dest2) == files_of(srcs[7])
    assert "ignoring the bridge of version 7" in caplog.text


def test_a_bridge_with_a_codec_record_that_cannot_be_decoded_falls_back(tmp_path, history):
    """A bridge that loads (its digest matches) but names a codec record no decoder takes made the pull exit 5 (a
    format error in the version, as if the store were damaged); a bridge is only an accelerator: fall back."""
    store, srcs, _results, repo = history
    dest = _pull_at(store, tmp_path / "dest", 3)
    bridge = load_bridge(repo, repo.manifest(4))
    assert bridge is not None

    def broken(rec):  # type: ignore[no-untyped-def]
        return replace(rec, codec={**rec.codec, "width": 3})  # no element is 3 bytes wide

    done = []
    files = []
    for f in bridge.files:
        segs = []
        for seg in f.segments:
            chunks = []
            for rec in seg.chunks:
                if not done and rec.codec["name"] not in ("same", "raw"):
                    rec = broken(rec)
                    done.append(rec)
                chunks.append(rec)
            segs.append(replace(seg, chunks=tuple(chunks)))
        files.append(replace(f, segments=tuple(segs)))
    assert done
    forged = replace(bridge, files=tuple(files), digest=None).sealed()
    repo.objects.put(bridge_key(4), forged.encode())
    assert load_bridge(repo, repo.manifest(4)) is not None  # usable as far as a reader can tell before decoding
    res = pull(store, str(dest), version=4)
    assert res.fallback and res.from_full and files_of(dest) == files_of(srcs[4])


def test_no_bridge_when_asked_or_when_the_cache_does_not_hold_the_parent(tmp_path):
    results = {}
    for name in ("a", "b"):
        store, gen = str(tmp_path / name), MovingSubset(tmp_path / f"src-{name}")
        push(store, gen.write(), cache_dir=str(tmp_path / f"cache-{name}"))
        push(store, gen.write(), cache_dir=str(tmp_path / f"cache-{name}"))
        # a: asked not to; b: a trainer restarted with an empty cache (the parent is not rebuilt from the store
        # just for a bridge)
        cache = str(tmp_path / ("cache-a" if name == "a" else "fresh-cache"))
        results[name] = push(store, gen.write(), full=True, bridge=(name == "b"), cache_dir=cache)
        assert results[name].kind == "full" and results[name].bridge_bytes == 0 and not results[name].base_rederived
        assert Repository.open(store).objects.list("bridges") == []
    out = run_cli("push", str(tmp_path / "src-a" / "step1"), str(tmp_path / "a"), "--full", "--no-bridge",
                  "--cache", str(tmp_path / "cache-a"))
    assert out.returncode == 0, out.stderr
    assert Repository.open(str(tmp_path / "a")).objects.list("bridges") == []


def test_the_bridge_is_in_the_store_before_the_version_is_visible(tmp_path, monkeypatch):
    store = str(tmp_path / "store")
    gen = MovingSubset(tmp_path / "src")
    push(store, gen.write())
    push(store, gen.write())
    seen = []
    real = pipeline.commit_version

    def commit(repo, man, **kw):
        seen.append((man.version, repo.objects.exists(bridge_key(man.version))))
        return real(repo, man, **kw)

    monkeypatch.setattr(pipeline, "commit_version", commit)
    res = push(store, gen.write(), full=True)
    assert res.bridge_bytes > 0 and seen == [(3, True)]


def test_a_full_version_pushed_from_tensors_gets_its_bridge(tmp_path):
    torch = pytest.importorskip("torch")
    store = str(tmp_path / "store")
    rng = np.random.default_rng(1)
    w = torch.from_numpy(rng.standard_normal((256, 512)).astype(np.float32)).to(torch.bfloat16)
    b = torch.from_numpy(rng.standard_normal(512).astype(np.float32))
    push_tensors(store, {"w": w, "b": b})
    flat = w.view(-1)
    flat[::37] = flat[::37] * 1.01
    res = push_tensors(store, {"w": w, "b": b}, full=True)
    assert res.kind == "full" and res.bridge_bytes > 0
    repo = Repository.open(store)
    dest = _pull_at(store, tmp_path / "dest", 1)
    res = pull(store, str(dest), version=2)
    assert not res.from_full and res.bytes_read < chain_cost([repo.manifest(2)]) / 4
    assert verify(store, local=str(dest)).ok


def test_gc_keeps_the_bridges_of_kept_full_versions_and_removes_the_rest(tmp_path, history):
    store, srcs, _results, repo = history
    dest = _pull_at(store, tmp_path / "dest", 6)  # a host at 6, whose version gc is about to remove
    plan = gc(store, keep_last=2, grace=0, dry_run=True).plan
    assert sorted(plan.keep) == [7, 8] and list(plan.bridges) == [4]
    gc(store, keep_last=2, grace=0, settle=0)
    repo = Repository.open(store)
    assert repo.versions() == [7, 8] and repo.objects.list("bridges") == [bridge_key(7)]
    assert verify(store, all_versions=True).ok
    # The host at 6 still crosses to 7 by the bridge, though version 6's manifest is gone from the store.
    res = pull(store, str(dest), version=8)
    assert not res.from_full and not res.fallback and files_of(dest) == files_of(srcs[8])
    again = gc(store, keep_last=2, grace=0, dry_run=True).plan
    assert again.chunks == {} and again.bridges == {}


def test_gc_leaves_the_bridge_of_a_version_not_yet_committed(tmp_path, history):
    store, _srcs, _results, repo = history
    pending = replace(load_bridge(repo, repo.manifest(7)), version=9).sealed()  # what a push writes before its commit
    repo.objects.put(bridge_key(9), pending.encode())
    plan = gc(store, keep_last=8, grace=0, dry_run=True).plan
    assert plan.bridges == {}
    # Once version 9 exists and the bridge does not match it (its push died; another push committed 9), it goes.
    push(store, str(MovingSubset(tmp_path / "src2").write()), version=9, cache_dir=str(tmp_path / "other-cache"))
    assert list(gc(store, keep_last=9, grace=0, dry_run=True).plan.bridges) == [9]


_KILLED_BEFORE_COMMIT = """
import sys, time
from deltafs.publish import pipeline, push
def park(*a, **k):
    print("parked", flush=True)
    time.sleep(3600)
pipeline.commit_version = park
push(sys.argv[1], sys.argv[2], full=True, cache_dir=sys.argv[3])
"""


def test_a_push_killed_between_its_bridge_and_its_commit_leaves_nothing_visible(tmp_path):
    store, cache = str(tmp_path / "store"), str(tmp_path / "cache")
    gen = MovingSubset(tmp_path / "src")
    srcs = {}
    for v in (1, 2, 3):
        srcs[v] = gen.write()
    push(store, srcs[1], cache_dir=cache)
    push(store, srcs[2], cache_dir=cache)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_BEFORE_COMMIT, store, srcs[3], cache],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "parked"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)
    repo = Repository.open(store)
    assert repo.versions() == [1, 2] and repo.read_head().version == 2
    assert repo.objects.exists(bridge_key(3))  # the bridge of a version that never came to be
    assert verify(store, all_versions=True).ok
    assert gc(store, keep_last=2, grace=0, dry_run=True).plan.bridges == {}  # might be a push in flight
    dest = _pull_at(store, tmp_path / "dest", 2)
    # The trainer pushes again: the new version 3 replaces the stale bridge with its own, which a host at 2 uses.
    res = push(store, srcs[3], full=True, cache_dir=cache)
    assert res.version == 3 and res.bridge_bytes > 0
    assert load_bridge(repo, repo.manifest(3)) is not None
    res = pull(store, str(dest), version=3)
    assert not res.from_full and files_of(dest) == files_of(srcs[3])


def test_two_full_versions_in_a_row_are_crossed_by_both_bridges(tmp_path):
    store = str(tmp_path / "store")
    gen = MovingSubset(tmp_path / "src")
    srcs = {}
    for v, full in [(1, False), (2, False), (3, True), (4, True), (5, False)]:
        srcs[v] = gen.write()
        assert push(store, srcs[v], full=full).bridge_bytes > 0 or v < 3 or not full
    repo = Repository.open(store)
    dest = _pull_at(store, tmp_path / "dest", 2)
    chain = plan_chain(repo, 5, local_version(str(dest)), bridges=MAX_BRIDGES)
    assert [(m.version, "bridge_of" in m.stats) for m in chain.steps] == [(3, True), (4, True), (5, False)]
    res = pull(store, str(dest), version=5)
    assert not res.from_full and res.bytes_read == chain_cost(chain.steps) and files_of(dest) == files_of(srcs[5])
    # ... and when the target is the second of them, the version installed is its own manifest.
    dest2 = _pull_at(store, tmp_path / "dest2", 2)
    res = pull(store, str(dest2), version=4)
    assert not res.from_full and local_version(str(dest2)).digest == repo.manifest(4).digest
    assert files_of(dest2) == files_of(srcs[4])


def test_verify_all_rebuilds_the_bridges_and_warns_about_a_broken_one(tmp_path, history):
    store, _srcs, _results, repo = history
    rep = verify(store, all_versions=True)
    assert rep.ok and rep.bridges_checked == 2 and rep.warnings == []
    out = run_cli("verify", store, "--all")
    assert out.returncode == 0 and "2 keyframe bridges rebuilt" in out.stdout, out.stdout
    # A chunk only the bridge of 4 names, flipped: every version still verifies, the bridge is reported.
    bridge = load_bridge(repo, repo.manifest(4))
    own = {c.object for v in repo.versions() for f in repo.manifest(v).files for s in f.segments for c in s.chunks}
    oid = next(c.object for f in bridge.files for s in f.segments for c in s.chunks
               if c.object is not None and c.object not in own)
    path = tmp_path / "store" / "chunks" / oid[:2] / oid
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    repo.objects.put(bridge_key(7), b"garbage")
    rep = verify(store, all_versions=True)
    assert rep.ok and rep.bridges_checked == 0 and len(rep.warnings) == 2
    assert "the bridge of version 4" in rep.warnings[0] and "does not rebuild version 4" in rep.warnings[0]
    assert "the bridge of version 7" in rep.warnings[1] and "unusable" in rep.warnings[1]
    out = run_cli("verify", store, "--all")
    assert out.returncode == 0 and out.stdout.count("warning: ") == 2, out.stdout
