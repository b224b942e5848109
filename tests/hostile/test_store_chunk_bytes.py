"""A manifest's chunk_bytes must equal the store's (deltafs.json) before any chunk is read or decompressed."""

from __future__ import annotations

import json
import os
import shutil

from deltafs.format.manifest import manifest_key
from deltafs.publish import push
from deltafs.store.repo import Repository
from deltafs.testing.checkpoints import run_cli


def test_manifest_declaring_huge_chunks_is_refused_before_any_chunk(tmp_path, maker):
    small = str(tmp_path / "small")
    Repository.open(small, create=True, chunk_bytes=4096)
    push(small, maker.write())
    # The same store id with 1 GiB chunks: a valid, sealed manifest whose chunks claim up to 1 GiB each.
    big = str(tmp_path / "big")
    os.makedirs(big)
    config = json.loads(open(os.path.join(small, "deltafs.json")).read())
    config["chunk_bytes"] = 1 << 30
    open(os.path.join(big, "deltafs.json"), "w").write(json.dumps(config))
    maker.advance()
    push(big, maker.write(), version=2, cache_dir=str(tmp_path / "cache-big"))
    shutil.copy(os.path.join(big, manifest_key(2)), os.path.join(small, manifest_key(2)))
    shutil.copytree(os.path.join(big, "chunks"), os.path.join(small, "chunks"), dirs_exist_ok=True)
    proc = run_cli("pull", small, tmp_path / "dest", "--version", "2")
    assert proc.returncode == 5, (proc.returncode, proc.stdout, proc.stderr)
    assert "declares chunk_bytes 1073741824" in proc.stderr and "4096" in proc.stderr, proc.stderr
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
