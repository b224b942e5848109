"""gc keeps what kept versions need, frees the rest, honours the grace period and the store lock."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import replace

import pytest

from deltafs.errors import LockHeldError, UsageError, VersionNotFoundError
from deltafs.maintenance.gc import gc, make_plan
from deltafs.store.lock import process_space, GC_LOCK_KEY, StoreLock
from deltafs.maintenance.verify import verify
from deltafs.publish import push
from deltafs.store.accelerators import load_bridge
from deltafs.read.pull import pull
from deltafs.store.repo import Repository
from deltafs.testing.checkpoints import files_of, run_cli

from history_helpers import push_history, store_bytes


def _chunks_on_disk(store: str) -> set[str]:
    out = set()
    for _dirpath, _dirs, files in os.walk(os.path.join(store, "chunks")):
        out.update(f for f in files if not f.startswith(".tmp-"))
    return out


def _referenced(repo: Repository, versions, *, bridges: bool = True) -> set[str]:
    """The objects the versions' manifests name, and those of their bridges (a kept full version keeps its own)."""
    mans = [repo.manifest(v) for v in versions]
    mans += [b for m in mans if (b := load_bridge(repo, m)) is not None] if bridges else []
    return {ch.object for m in mans for f in m.files for s in f.segments for ch in s.chunks if ch.object is not None}


def test_keep_last_keeps_chains_and_frees_everything_else(tmp_path, maker):
    store = str(tmp_path / "store")
    srcs = push_history(store, maker, 8, keyframe_every=3)  # full: 1, 4, 7
    repo = Repository.open(store)
    assert [v for v in repo.versions() if repo.manifest(v).kind == "full"] == [1, 4, 7]
    before = store_bytes(store)

    dry = gc(store, keep_last=3, grace=0, dry_run=True)
    assert store_bytes(store) == before  # a dry run changes nothing
    assert sorted(dry.plan.keep) == [4, 5, 6, 7, 8]  # 6 needs 5 and the full version 4
    assert dry.plan.keep[4] == "chain of 6" and dry.plan.keep[8] == "head"
    assert dry.plan.remove == [3, 2, 1]

    res = gc(store, keep_last=3, grace=0, settle=0)
    assert res.versions_removed == [3, 2, 1]
    assert before - store_bytes(store) == dry.plan.bytes_freed == res.bytes_freed  # the dry run told the truth
    repo = Repository.open(store)
    assert repo.versions() == [4, 5, 6, 7, 8]
    # Exactly the chunks the kept versions reference are left.
    assert _chunks_on_disk(store) == _referenced(repo, [4, 5, 6, 7, 8])
    assert verify(store, all_versions=True).ok
    for v in (4, 6, 8):
        dest = tmp_path / f"dest{v}"
        pull(store, str(dest), version=v)
        assert files_of(dest) == files_of(srcs[v])
    with pytest.raises(VersionNotFoundError):
        pull(store, str(tmp_path / "old"), version=2)


def test_keep_full_keeps_old_full_versions(tmp_path, maker):
    store = str(tmp_path / "store")
    srcs = push_history(store, maker, 8, keyframe_every=3)
    res = gc(store, keep_last=1, keep_full=2, grace=0)
    assert sorted(res.plan.keep) == [4, 7, 8]
    assert Repository.open(store).versions() == [4, 7, 8]
    assert verify(store, all_versions=True).ok
    pull(store, str(tmp_path / "d"), version=4)
    assert files_of(tmp_path / "d") == files_of(srcs[4])


def test_head_is_kept_even_if_head_pointer_lags(tmp_path, maker):
    store = str(tmp_path / "store")
    push_history(store, maker, 3, keyframe_every=2)
    repo = Repository.open(store)
    # A pusher that died between its manifest and HEAD: HEAD names version 2, version 3 exists.
    repo.objects.put("HEAD", json.dumps({"format": "deltafs.head", "format_version": 1, "version": 2,
                                         "digest": repo.manifest(2).digest}).encode())
    res = gc(store, keep_last=1, grace=0, settle=0)
    assert 2 in res.plan.keep and 3 in res.plan.keep
    assert verify(store, all_versions=True).ok


def test_grace_protects_chunks_of_a_push_in_flight_and_recent_heads(tmp_path, maker):
    store = str(tmp_path / "store")
    push_history(store, maker, 4, keyframe_every=2)  # full 1, 3
    repo = Repository.open(store)
    orphan, fresh = repo.put_chunk(b"chunk written by a push that has not committed yet")
    assert fresh
    plan = make_plan(repo, keep_last=1, grace=3600)
    # Every version was HEAD less than an hour ago: a reader may still be pulling it.
    assert sorted(plan.keep) == [1, 2, 3, 4] and plan.remove == []
    assert orphan not in plan.chunks and plan.chunks_too_young >= 1
    gc(store, keep_last=1, grace=3600)
    assert repo.has_chunk(orphan) and repo.versions() == [1, 2, 3, 4]
    # An hour later (as seen by the planner) both go.
    later = make_plan(repo, keep_last=1, grace=3600, now=time.time() + 7200)
    assert later.remove == [2, 1] and orphan in later.chunks
    gc(store, keep_last=1, grace=0, settle=0)
    assert not repo.has_chunk(orphan)
    assert verify(store, all_versions=True).ok


def test_gc_keeps_a_version_committed_while_it_runs(tmp_path, maker):
    """A push whose chunks were written before gc planned, and whose manifest commits while gc deletes."""
    store = str(tmp_path / "store")
    srcs = push_history(store, maker, 3, keyframe_every=2)  # full 1, 3
    repo = Repository.open(store)
    # Version 4 repeats version 1's bytes as a full version: every chunk it needs is one that gc
    # planned to delete with version 1 (written long ago, unreferenced by the kept version 3).
    v1, v3 = repo.manifest(1), repo.manifest(3)
    v4 = replace(v1, version=4, parent=3, parent_digest=v3.digest, stats={}).seal()
    committed = []

    def commit_in_the_middle(key: str) -> None:
        if not committed:
            committed.append(Repository.open(store).commit(v4))

    res = gc(store, keep_last=1, grace=0, settle=0, on_delete=commit_in_the_middle)
    assert committed and res.versions_removed == [2, 1]
    assert Repository.open(store).versions() == [3, 4]
    assert verify(store, all_versions=True).ok
    pull(store, str(tmp_path / "d"), version=4)
    assert files_of(tmp_path / "d") == files_of(srcs[1])


def test_push_that_reused_chunks_waits_for_gc_and_rewrites_what_gc_removed(tmp_path, maker):
    store = str(tmp_path / "store")
    srcs = push_history(store, maker, 3, keyframe_every=2)  # full 1, 3
    repo = Repository.open(store)
    lock = StoreLock(repo.objects)
    lock.acquire()  # a gc is running
    result = []
    pusher = threading.Thread(target=lambda: result.append(push(store, srcs[1], full=True)))
    pusher.start()  # dedups every chunk against version 1, then waits for the gc
    time.sleep(1.0)
    assert pusher.is_alive() and repo.versions() == [1, 2, 3]
    for oid in _referenced(repo, [1]) - _referenced(repo, [3]):  # what this gc deletes
        repo.objects.delete(f"chunks/{oid[:2]}/{oid}")
    lock.release()
    pusher.join(60)
    assert result and result[0].version == 4 and result[0].kind == "full"
    assert verify(store, all_versions=False).ok
    pull(store, str(tmp_path / "d"), version=4)
    assert files_of(tmp_path / "d") == files_of(srcs[1])


def test_second_gc_exits_cleanly_while_the_lock_is_held(tmp_path, maker):
    store = str(tmp_path / "store")
    push_history(store, maker, 3)
    repo = Repository.open(store)
    lock = StoreLock(repo.objects)
    lock.acquire()
    try:
        with pytest.raises(LockHeldError, match="locks/gc.json"):
            gc(store, keep_last=1, grace=0, settle=0)
        proc = run_cli("gc", store, "--keep-last", "1", "--grace", "0")
        assert proc.returncode == 8
        assert "is locked" in proc.stderr and f"pid {os.getpid()}" in proc.stderr
        assert repo.versions() == [1, 2, 3]  # nothing was removed
    finally:
        lock.release()
    assert not repo.objects.exists(GC_LOCK_KEY)


def test_second_gc_waits_for_the_lock(tmp_path, maker):
    store = str(tmp_path / "store")
    push_history(store, maker, 3)
    repo = Repository.open(store)
    lock = StoreLock(repo.objects)
    lock.acquire()
    threading.Timer(0.5, lock.release).start()
    t0 = time.monotonic()
    res = gc(store, keep_last=1, grace=0, wait=30, settle=0)
    assert time.monotonic() - t0 >= 0.4
    assert res.executed and not repo.objects.exists(GC_LOCK_KEY)


def _fake_lock(repo: Repository, *, host: str, pid: int, age: float, ns: str | None = None) -> None:
    repo.objects.put(GC_LOCK_KEY, json.dumps({"format": "deltafs.lock", "owner": "x", "host": host, "pid": pid,
                                              "created": time.time() - age, "purpose": "gc",
                                              **({"ns": ns} if ns else {})}).encode())


def test_stale_locks_are_taken_over(tmp_path, maker):
    store = str(tmp_path / "store")
    push_history(store, maker, 3, keyframe_every=2)
    repo = Repository.open(store)
    # A dead process on this host.
    _fake_lock(repo, host=socket.gethostname(), pid=2**22 + 12345, age=5, ns=process_space())
    assert gc(store, keep_last=1, grace=0, settle=0).executed
    # The same host name in another pid namespace (a container sharing the host's network): its pid cannot be
    # looked up from here, so it is held (two gcs ran at once, each calling the other's lock stale), and so is a
    # record without its namespace (an older deltafs).
    for ns in ("another-boot/pid:[4026531836]", None):
        _fake_lock(repo, host=socket.gethostname(), pid=2**22 + 12345, age=5, ns=ns)
        with pytest.raises(LockHeldError):
            gc(store, keep_last=1, grace=0, settle=0)
    # A live-looking holder on another host, but older than the stale age.
    _fake_lock(repo, host="elsewhere", pid=1, age=10)
    with pytest.raises(LockHeldError):
        gc(store, keep_last=1, grace=0, settle=0)
    assert gc(store, keep_last=1, grace=0, stale_after=5, settle=0).executed
    assert not repo.objects.exists(GC_LOCK_KEY)


def test_bad_arguments(tmp_path, maker):
    store = str(tmp_path / "store")
    push_history(store, maker, 1)
    with pytest.raises(UsageError):
        gc(store, keep_last=0)
    proc = run_cli("gc", store, "--keep-last", "0")
    assert proc.returncode == 2 and "--keep-last must be at least 1" in proc.stderr


def test_cli_dry_run_lists_what_would_go(tmp_path, maker):
    store = str(tmp_path / "store")
    push_history(store, maker, 5, keyframe_every=2)  # full 1, 3, 5
    before = store_bytes(store)
    proc = run_cli("gc", store, "--keep-last", "1", "--grace", "0", "--dry-run", check=0)
    assert "would remove versions: 1, 2, 3, 4" in proc.stdout and "would be freed" in proc.stdout
    assert store_bytes(store) == before
    proc = run_cli("gc", store, "--keep-last", "1", "--grace", "0", "--json", check=0)
    data = json.loads(proc.stdout)
    assert data["versions_removed"] == [4, 3, 2, 1]
    assert before - store_bytes(store) == data["bytes_freed"]
    run_cli("verify", store, "--all", check=0)


def test_gc_on_s3(s3_url, s3_options, tmp_path, maker):
    for _ in range(4):
        push(s3_url, maker.write(), storage_options=s3_options, keyframe_every=2)
        maker.advance()
    repo = Repository.open(s3_url, s3_options)
    orphan, _ = repo.put_chunk(b"young orphan")
    young = gc(s3_url, keep_last=1, grace=600, storage_options=s3_options)
    assert repo.has_chunk(orphan) and young.plan.chunks_too_young >= 1  # S3 LastModified is read
    # A foreign object under chunks/ (a readme an operator left) is never touched, and stops nothing (gc used to
    # exit 5 on it: "bad chunk object id").
    repo.objects.put("chunks/readme", b"not a chunk")
    res = gc(s3_url, keep_last=1, grace=0, storage_options=s3_options, settle=0)
    assert res.versions_removed == [2, 1]
    assert not repo.has_chunk(orphan)
    assert repo.objects.get("chunks/readme") == b"not a chunk"
    assert verify(s3_url, all_versions=True, storage_options=s3_options).ok


@pytest.mark.parametrize("where", ["chunks/ab", "bridges"])
def test_partial_writes_of_killed_processes_are_removed_after_the_grace_period(tmp_path, maker, where):
    """(Bridges are written through temp files too: one left there stayed forever.)"""
    store = str(tmp_path / "store")
    push_history(store, maker, 2)
    leftover = os.path.join(store, where, ".tmp-0123456789abcdef")
    os.makedirs(os.path.dirname(leftover), exist_ok=True)
    with open(leftover, "wb") as fh:
        fh.write(b"x" * 1000)  # what a push SIGKILLed in the middle of a chunk write leaves
    assert gc(store, keep_last=2, grace=3600, settle=0).plan.temp_files == {}  # maybe a write in flight
    assert os.path.exists(leftover)
    plan = gc(store, keep_last=2, grace=0, dry_run=True).plan
    assert plan.temp_files == {leftover: 1000} and plan.bytes_freed == 1000
    gc(store, keep_last=2, grace=0, settle=0)
    assert not os.path.exists(leftover)
    assert verify(store, all_versions=True).ok


def test_a_failing_gc_reports_its_own_failure_not_the_lock_release(tmp_path, maker, monkeypatch):
    """A store turned read-only during gc: the failed release of locks/gc.json hid the failed chunk delete."""
    from deltafs.errors import StoreError
    from deltafs.store.local import LocalObjectStore

    store = str(tmp_path / "store")
    push_history(store, maker, 3, keyframe_every=2)  # versions 1 and 2 can go
    real = LocalObjectStore._remove

    def read_only(self, key):
        raise OSError(30, "Read-only file system", key)

    monkeypatch.setattr(LocalObjectStore, "_remove", read_only)
    with pytest.raises(StoreError) as caught:
        gc(store, keep_last=1, grace=0, settle=0)
    assert "cannot delete manifests/" in str(caught.value), caught.value
    monkeypatch.setattr(LocalObjectStore, "_remove", real)


def test_an_unreadable_gc_lock_is_described_without_a_made_up_age(tmp_path):
    from deltafs.store.lock import LockInfo

    info = LockInfo("locks/gc.json", "?", "?", -1, time.time() - 900, "unreadable lock", b"")
    assert info.describe() == "an unreadable locks/gc.json (remove it if no gc is running)"


def test_gc_refuses_a_store_with_a_broken_chain_and_deletes_nothing(tmp_path, maker):
    store = str(tmp_path / "store")
    push_history(store, maker, 4, keyframe_every=100)
    repo = Repository.open(store)
    repo.objects.delete("manifests/v0000000002.json")  # version 3 and 4 can no longer be rebuilt
    before = store_bytes(store)
    proc = run_cli("gc", store, "--keep-last", "1", "--grace", "0")
    assert proc.returncode == 6 and "gc stopped: version 4 cannot be rebuilt" in proc.stderr
    assert "deltafs verify --all" in proc.stderr
    assert store_bytes(store) == before and not repo.objects.exists(GC_LOCK_KEY)


def test_links_planted_in_the_store_are_sized_and_removed_as_links(tmp_path, maker):
    """A symbolic link planted where gc deletes (a chunk name, a fold, a bridge; one dangling): the plan counts the
    link's own size, gc removes the link and exits 0, and what a link points at is untouched. Before, gc sized a
    link by its target and a dangling one under bridges/ stopped it with "not found" (exit 3)."""
    store = str(tmp_path / "store")
    push_history(store, maker, 4, keyframe_every=3)  # full: 1, 4 (with a bridge)
    target = tmp_path / "precious.bin"
    target.write_bytes(b"x" * 100_000)
    oid = "ab" + "0" * 62
    planted = {os.path.join(store, "chunks", "ab", oid): str(target),
               os.path.join(store, "folds", "v0000000002.json"): str(target),
               os.path.join(store, "bridges", "v0000000003.json"): str(tmp_path / "nowhere")}
    for link, to in planted.items():
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(to, link)
    plan = gc(store, keep_last=1, grace=0, dry_run=True).plan
    assert plan.chunks[oid] == len(str(target))
    assert plan.folds[2] == len(str(target)) and plan.bridges[3] == len(str(tmp_path / "nowhere"))
    out = run_cli("gc", store, "--keep-last", "1", "--grace", "0")
    assert out.returncode == 0, out.stderr
    assert not any(os.path.lexists(link) for link in planted)
    assert target.read_bytes() == b"x" * 100_000
    assert verify(store).ok


def test_a_store_outage_while_gc_reads_manifests_is_exit_3_not_a_damaged_store(tmp_path, maker, monkeypatch):
    """A connection closed while gc read a manifest said "the manifest of version 3 cannot be read ...; run
    'deltafs verify --all'", exit 5 (malformed): a network outage reported as a damaged store (adversarial pass)."""
    from deltafs.errors import StoreError, exit_code
    from deltafs.store.repo import Repository

    store = str(tmp_path / "store")
    for _ in range(3):
        push(store, maker.write())
        maker.advance()
    before = sorted(os.listdir(os.path.join(store, "manifests")))
    real = Repository.manifest

    def outage(self, version):
        if version == 2:
            raise StoreError(f"cannot read manifests/{version} at {store} after 5 attempts: Connection was closed")
        return real(self, version)

    monkeypatch.setattr(Repository, "manifest", outage)
    with pytest.raises(StoreError, match="gc stopped before removing anything: the manifest of version 2") as info:
        gc(store, keep_last=1, grace=0, settle=0)
    assert exit_code(info.value) == 3 and "verify" not in str(info.value)
    assert sorted(os.listdir(os.path.join(store, "manifests"))) == before


def test_a_gc_whose_lock_another_gc_took_over_stops_before_deleting_chunks(tmp_path, maker):
    """Two gcs taking over one stale lock at once can both believe they hold it: each reads it stale, one deletes it
    and creates its own, the other's delete (a slow round trip later) removes that one and creates a third. The
    first then deleted chunks under a lock no longer its own: once the second released, a push saw no gc and
    committed chunks the first was deleting (adversarial pass). A gc checks its lock before its chunk deletions."""
    store = str(tmp_path / "store")
    push_history(store, maker, 3, keyframe_every=2)  # full 1, 3
    before = _chunks_on_disk(store)
    objects = Repository.open(store).objects
    other = StoreLock(objects, purpose="gc")

    def taken_over(key: str) -> None:  # the other gc's delete of "the stale lock", then its own lock
        if not other.held:
            objects.delete(GC_LOCK_KEY)
            other.acquire()

    with pytest.raises(LockHeldError, match="was taken by .* while this gc held it"):
        gc(store, keep_last=1, grace=0, settle=0, on_delete=taken_over)
    assert _chunks_on_disk(store) == before  # no chunk deleted after the lock was lost
    assert Repository.open(store).versions() == [1, 3]  # nor a manifest after the first (the takeover's moment)
    assert StoreLock(objects).try_acquire() is not None  # the other gc's lock is left alone
    other.release()


@pytest.mark.parametrize("what", ["bridges", "folds"])
def test_a_kept_versions_bridge_or_fold_that_cannot_be_read_now_stops_gc(tmp_path, maker, what):
    """A store error reading a kept version's bridge or fold (a timeout after the retries) was taken for "unusable":
    gc deleted it and the objects only it names, for good, and a host at the parent then read the whole version. It
    stops gc now (exit 3), as a manifest that cannot be read does; a damaged one is still removed."""
    from deltafs.errors import StoreError, exit_code
    from deltafs.format.keys import bridge_key, fold_key
    from deltafs.store.repo import Repository

    store = str(tmp_path / "store")
    push_history(store, maker, 5, keyframe_every=3, fold=True)  # full 1 and 4 (bridge 4); fold of 3 (and 5)
    key = bridge_key(4) if what == "bridges" else fold_key(3)
    repo = Repository.open(store)
    assert repo.objects.exists(key)
    real = repo.objects.get

    def flaky(k, *args, **kwargs):  # type: ignore[no-untyped-def]
        if k == key:
            raise StoreError(f"cannot read {k} at {store} after 5 attempts: Read timed out")
        return real(k, *args, **kwargs)

    repo.objects.get = flaky  # type: ignore[method-assign]
    before = store_bytes(store)
    with pytest.raises(StoreError, match=f"gc stopped: {key} cannot be read") as err:
        gc(repo, keep_last=3, grace=0, settle=0)
    assert exit_code(err.value) == 3
    assert store_bytes(store) == before and os.path.exists(os.path.join(store, key))
    gc(store, keep_last=3, grace=0, settle=0)  # readable again: kept
    assert os.path.exists(os.path.join(store, key)) and verify(store, all_versions=True).ok


def test_a_bridge_damaged_on_one_read_is_read_again_before_gc_removes_it(tmp_path, maker):
    """One GET of a kept version's bridge cut short by the network (the stored object intact) made gc remove it and
    the objects only it names, for good. gc reads an unusable bridge or fold again: other bytes stop gc (exit 3);
    the same bytes twice (damaged in the store) still remove it."""
    from deltafs.errors import StoreError, exit_code
    from deltafs.format.keys import bridge_key
    from deltafs.store.repo import Repository

    store = str(tmp_path / "store")
    push_history(store, maker, 5, keyframe_every=3)  # full 1 and 4 (bridge 4)
    key = bridge_key(4)
    intact = open(os.path.join(store, key), "rb").read()

    def damaging(repo, reads):  # type: ignore[no-untyped-def]
        real = repo.objects.get

        def get(k, *args, **kwargs):  # type: ignore[no-untyped-def]
            data = real(k, *args, **kwargs)
            if k == key and reads:
                return reads.pop(0)(data)
            return data

        repo.objects.get = get  # type: ignore[method-assign]
        return repo

    once = damaging(Repository.open(store), [lambda d: d[:100]])
    gc(once, keep_last=2, grace=0, settle=0)  # cut short once, intact the second time: kept
    assert open(os.path.join(store, key), "rb").read() == intact
    twice = damaging(Repository.open(store), [lambda d: d[:100], lambda d: d[:90]])
    with pytest.raises(StoreError, match=f"gc stopped: {key} cannot be read .*came back with other bytes") as err:
        gc(twice, keep_last=2, grace=0, settle=0)
    assert exit_code(err.value) == 3 and open(os.path.join(store, key), "rb").read() == intact
    with open(os.path.join(store, key), "r+b") as fh:  # damaged in the store: every read the same
        fh.truncate(100)
    gc(store, keep_last=2, grace=0, settle=0)
    assert not os.path.exists(os.path.join(store, key)) and verify(store, all_versions=True).ok
