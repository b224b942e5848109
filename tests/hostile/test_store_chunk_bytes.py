"""A manifest's chunk_bytes must equal the store's (deltafs.json) before any chunk is read or decompressed."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from deltafs.errors import UsageError
from deltafs.format.manifest import manifest_key
from deltafs.publish import push
from deltafs.store.repo import Repository
from deltafs.testing.checkpoints import run_cli


def test_manifest_declaring_huge_chunks_is_refused_before_any_chunk(tmp_path, maker):
    small = str(tmp_path / "small")
    Repository.open(small, create=True, chunk_bytes=4096)
    push(small, maker.write())
    # The same store id with 128 MiB chunks: a valid, sealed manifest whose chunks claim up to 128 MiB each.
    big = str(tmp_path / "big")
    os.makedirs(big)
    config = json.loads(open(os.path.join(small, "deltafs.json")).read())
    config["chunk_bytes"] = 1 << 27
    open(os.path.join(big, "deltafs.json"), "w").write(json.dumps(config))
    maker.advance()
    push(big, maker.write(), version=2, cache_dir=str(tmp_path / "cache-big"))
    shutil.copy(os.path.join(big, manifest_key(2)), os.path.join(small, manifest_key(2)))
    shutil.copytree(os.path.join(big, "chunks"), os.path.join(small, "chunks"), dirs_exist_ok=True)
    proc = run_cli("pull", small, tmp_path / "dest", "--version", "2")
    assert proc.returncode == 5, (proc.returncode, proc.stdout, proc.stderr)
    assert "declares chunk_bytes 134217728" in proc.stderr and "4096" in proc.stderr, proc.stderr
    assert not os.path.lexists(tmp_path / "dest")


def test_store_config_edited_after_the_fact(tmp_path, maker):
    url = str(tmp_path / "store")
    Repository.open(url, create=True, chunk_bytes=4096)
    push(url, maker.write())
    path = os.path.join(url, "deltafs.json")
    config = json.loads(open(path).read())
    config["chunk_bytes"] = 8192
    open(path, "w").write(json.dumps(config))
    proc = run_cli("verify", url, "--all")
    assert proc.returncode != 0 and "declares chunk_bytes 4096" in proc.stdout + proc.stderr, (proc.stdout, proc.stderr)


def test_a_store_declaring_chunks_no_host_could_hold_is_refused_before_any_allocation(tmp_path, maker):
    """deltafs.json and every manifest (re-sealed) claimed 1 TiB chunks: each pull worker died allocating its buffer,
    the build counted as done, and pull installed all-zero files with exit 0 (verify said ok too)."""
    url = str(tmp_path / "store")
    push(url, maker.write())
    path = os.path.join(url, "deltafs.json")
    config = json.loads(open(path).read())
    config["chunk_bytes"] = 1 << 40
    open(path, "w").write(json.dumps(config))
    for cmd in (["pull", url, tmp_path / "dest"], ["verify", url]):
        proc = run_cli(*cmd)
        assert proc.returncode == 5, (cmd, proc.returncode, proc.stdout, proc.stderr)
        assert "chunk_bytes must be a positive multiple of 8 of at most 268435456" in proc.stdout + proc.stderr
    assert not os.path.lexists(tmp_path / "dest")
    with pytest.raises(UsageError, match="chunk_bytes must be"):
        Repository.open(str(tmp_path / "other"), create=True, chunk_bytes=1 << 30)
    assert not os.path.exists(tmp_path / "other" / "deltafs.json")


def test_a_pull_worker_that_cannot_start_fails_the_pull_and_installs_nothing(tmp_path, maker, monkeypatch):
    import deltafs.read.rebuild as rebuild
    from deltafs.read.pull import pull

    url = str(tmp_path / "store")
    push(url, maker.write())

    def no_memory(size):
        raise MemoryError(f"cannot allocate {size} bytes")

    monkeypatch.setattr(rebuild, "aligned_empty", no_memory)
    with pytest.raises(MemoryError):
        pull(url, str(tmp_path / "dest"))
    assert not os.path.lexists(tmp_path / "dest") or not os.listdir(tmp_path / "dest")
