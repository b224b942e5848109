"""10.1: gc refuses to run when manifests/ holds a manifest it cannot parse or place, so the chunks
of such a version are never deleted as garbage."""

from __future__ import annotations

import os
import shutil

from deltafs.format.manifest import manifest_key
from deltafs.publish import push

from .conftest import deltafs, one_line


def _chunk_files(store: str) -> list[str]:
    return sorted(os.path.join(d, n) for d, _s, files in os.walk(os.path.join(store, "chunks")) for n in files)


def test_gc_stops_at_a_manifest_with_a_13_digit_version(tmp_path, maker):
    store = str(tmp_path / "store")
    push(store, maker.write())
    maker.advance()
    push(store, maker.write("b"), full=True)  # version 2 stands alone: version 1's chunks look unreferenced
    # What an older deltafs wrote for `--version 1733011200000`: a manifest no lister places.
    shutil.move(os.path.join(store, manifest_key(1)), os.path.join(store, "manifests", "v1733011200000.json"))
    chunks = _chunk_files(store)
    one_line(deltafs("gc", store, "--keep-last", "1", "--grace", "0"), 5, "gc stopped", "v1733011200000.json")
    assert _chunk_files(store) == chunks
    proc = deltafs("verify", store, "--all", "--quick")
    assert proc.returncode == 6 and "v1733011200000.json" in proc.stdout


def test_gc_stops_at_an_unreadable_manifest(tmp_path, maker):
    store = str(tmp_path / "store")
    push(store, maker.write())
    maker.advance()
    push(store, maker.write("b"))
    with open(os.path.join(store, manifest_key(1)), "r+b") as fh:
        fh.truncate(10)
    chunks = _chunk_files(store)
    one_line(deltafs("gc", store, "--keep-last", "1", "--grace", "0"), 5, "gc stopped", "version 1")
    assert _chunk_files(store) == chunks
