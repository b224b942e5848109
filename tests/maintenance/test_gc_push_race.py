"""gc racing a real push that runs longer than gc's grace period (issue 10.3).

The push runs in its own process and is frozen (SIGSTOP) after it has written some chunks; gc runs
with grace 0, so every chunk no manifest references is old enough to go. The push's in-flight
marker must keep its chunks, or, once the marker has expired, the push must notice and write them
again: either way it commits a version that verifies and pulls back byte for byte.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from deltafs.maintenance.gc import gc
from deltafs.maintenance.verify import verify
from deltafs.publish import push
from deltafs.read.pull import pull
from deltafs.store.repo import Repository
from deltafs.testing.checkpoints import files_of, write_safetensors

PUSH = "import sys; from deltafs.publish import push; push(sys.argv[1], sys.argv[2], cache_dir=sys.argv[3], threads=1, level=9)"


def _chunks(store: str) -> set[str]:
    out = set()
    for _dir, _sub, files in os.walk(os.path.join(store, "chunks")):
        out.update(f for f in files if not f.startswith(".tmp-"))
    return out


def _source(path: str, seed: int) -> str:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 1 << 16, 8 << 20, dtype=np.uint16).tobytes()  # 16 MiB, 256 chunks of 64 KiB
    write_safetensors(os.path.join(path, "model.safetensors"), {"w": ("BF16", (8 << 20,), data)})
    return path


def _frozen_push(tmp_path, env: dict[str, str]) -> tuple[str, str, subprocess.Popen[bytes], set[str]]:
    """A store with version 1, and a push of an unrelated version 2 frozen after writing a few chunks."""
    store = str(tmp_path / "store")
    Repository.open(store, create=True, chunk_bytes=64 << 10)
    push(store, _source(str(tmp_path / "v1"), 1), cache_dir=str(tmp_path / "cache-1"))
    before = _chunks(store)
    src = _source(str(tmp_path / "v2"), 2)
    proc = subprocess.Popen([sys.executable, "-c", PUSH, store, src, str(tmp_path / "cache-2")],
                            env={**os.environ, **env})
    while len(_chunks(store) - before) < 4 and proc.poll() is None:
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGSTOP)
    assert proc.poll() is None, "the push finished before it could be frozen"
    return store, src, proc, _chunks(store) - before


def _resume_and_check(tmp_path, store: str, src: str, proc: subprocess.Popen[bytes]) -> None:
    os.kill(proc.pid, signal.SIGCONT)
    assert proc.wait(timeout=600) == 0
    repo = Repository.open(store)
    assert repo.versions() == [1, 2]
    assert verify(store, all_versions=True).ok
    pull(store, str(tmp_path / "dest"))
    assert files_of(tmp_path / "dest") == files_of(src)


def test_gc_spares_the_chunks_of_a_push_in_flight(tmp_path):
    store, src, proc, written = _frozen_push(tmp_path, {})
    try:
        res = gc(store, keep_last=1, grace=0, settle=0)
        assert res.plan.push_markers and res.plan.chunks_in_flight >= len(written)
        assert written <= _chunks(store)  # nothing the push wrote was removed
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    _resume_and_check(tmp_path, store, src, proc)


def test_a_push_frozen_past_its_marker_writes_removed_chunks_again(tmp_path):
    store, src, proc, written = _frozen_push(tmp_path, {"DELTAFS_PUSH_MARKER_TTL": "1"})
    try:
        time.sleep(1.5)  # the marker expires: to gc the push looks dead
        res = gc(store, keep_last=1, grace=0, settle=0)
        assert not res.plan.push_markers and res.plan.dead_markers
        assert not written & _chunks(store)  # gc removed what the frozen push had written
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    _resume_and_check(tmp_path, store, src, proc)


@pytest.mark.parametrize("grace", [0.0])
def test_gc_removes_the_chunks_of_a_dead_push_once_its_marker_expired(tmp_path, grace):
    """A push killed mid-way leaves a marker; after its ttl gc removes the marker and the push's chunks."""
    store = str(tmp_path / "store")
    Repository.open(store, create=True, chunk_bytes=64 << 10)
    push(store, _source(str(tmp_path / "v1"), 1), cache_dir=str(tmp_path / "cache-1"))
    before = _chunks(store)
    src = _source(str(tmp_path / "v2"), 2)
    proc = subprocess.Popen([sys.executable, "-c", PUSH, store, src, str(tmp_path / "cache-2")],
                            env={**os.environ, "DELTAFS_PUSH_MARKER_TTL": "1"})
    while len(_chunks(store) - before) < 4 and proc.poll() is None:
        time.sleep(0.002)
    proc.kill()
    proc.wait()
    time.sleep(1.5)
    res = gc(store, keep_last=1, grace=grace, settle=0)
    assert res.plan.dead_markers and not res.plan.push_markers
    assert _chunks(store) == before
    assert not [k for k in os.listdir(os.path.join(store, "locks")) if k.startswith("push-")]
    assert verify(store, all_versions=True).ok


@pytest.mark.parametrize("ttl", [None, "1"], ids=["default-ttl", "short-ttl"])
def test_a_push_slow_between_its_chunk_check_and_its_commit_keeps_its_reused_chunks(tmp_path, monkeypatch, ttl):
    """A push reusing old objects (left by a killed attempt) checked them, then took longer than gc's settle time to
    write its manifest (a slow PUT; or frozen past its marker's ttl): a gc starting in between removed them and the
    push committed a version that could not be pulled (adversarial pass). Its marker now says "committing" from
    before the check, and gc waits for such a push before it removes any chunk."""
    import threading

    import deltafs.store.repo as repo_mod

    if ttl:
        monkeypatch.setenv("DELTAFS_PUSH_MARKER_TTL", ttl)
    store, src = str(tmp_path / "store"), _source(str(tmp_path / "v1"), 1)
    push(store, src, cache_dir=str(tmp_path / "c1"))
    src2 = _source(str(tmp_path / "v2"), 2)
    real = repo_mod.Repository.commit

    def killed(self, man):
        raise KeyboardInterrupt  # the first attempt dies after its chunks, before its manifest

    monkeypatch.setattr(repo_mod.Repository, "commit", killed)
    with pytest.raises(KeyboardInterrupt):
        push(store, src2, cache_dir=str(tmp_path / "c2"), full=True, bridge=False)
    old = time.time() - 7200
    for name in _chunks(store):
        os.utime(os.path.join(store, "chunks", name[:2], name), (old, old))  # hours before the next attempt
    reached = threading.Event()

    def slow(self, man):
        reached.set()
        time.sleep(3)  # longer than gc's settle time (2 s), and than a 1 s ttl
        return real(self, man)

    monkeypatch.setattr(repo_mod.Repository, "commit", slow)
    done: list[object] = []
    pusher = threading.Thread(target=lambda: done.append(push(store, src2, cache_dir=str(tmp_path / "c3"), full=True,
                                                               bridge=False)))
    pusher.start()
    assert reached.wait(60)
    result = gc(store, keep_last=1)  # default grace (1 h): the reused objects are older
    pusher.join(60)
    assert done and done[0].version == 2 and result.executed
    assert verify(store, deep=True).ok
    pull(store, str(tmp_path / "dest"))
    assert files_of(str(tmp_path / "dest")) == files_of(src2)


def test_a_chunk_a_push_finds_already_in_s3_is_checked_before_its_commit(s3_url, s3_options, tmp_path, maker,
                                                                          monkeypatch):
    """A push that writes a chunk already in the store (an unreferenced one from a removed version, or any other)
    must check it before its commit: its age does not fall under the push's in-flight marker, so a running gc may
    delete it. On S3 the create answered 412 and the equal bytes counted as this push's own write: no check, and a
    version (HEAD) committed without a chunk that gc had removed meanwhile (adversarial pass, moto)."""
    from deltafs.format.manifest import referenced_objects
    from deltafs.publish import commit

    first = maker.write()
    push(s3_url, first, storage_options=s3_options, cache_dir=str(tmp_path / "cache"))
    maker.advance()
    push(s3_url, maker.write(), storage_options=s3_options, cache_dir=str(tmp_path / "cache"))
    repo = Repository.open(s3_url, s3_options)
    victim = sorted(referenced_objects(repo.manifest(1).files))[0]
    real = commit.ensure_chunks
    removed: list[str] = []

    def gc_meanwhile(repo_, files, stats, **kw):  # a gc deletes the chunk between its write and the commit
        if not removed:
            repo_.objects.delete(f"chunks/{victim[:2]}/{victim}")
            removed.append(victim)
        return real(repo_, files, stats, **kw)

    monkeypatch.setattr(commit, "ensure_chunks", gc_meanwhile)
    res = push(s3_url, first, storage_options=s3_options, cache_dir=str(tmp_path / "cache"), full=True)
    assert removed and res.version == 3
    assert verify(s3_url, version=3, storage_options=s3_options).ok
    dest = str(tmp_path / "dest")
    pull(s3_url, dest, storage_options=s3_options)
    assert files_of(dest) == files_of(first)
