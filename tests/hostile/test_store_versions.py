"""The version lister misses no manifest: every key under manifests/ is a version or reported as a stray."""

from __future__ import annotations

import os
import shutil

import pytest

from deltafs.format.keys import MAX_VERSION, manifest_key
from deltafs.publish import push
from deltafs.store.repo import Repository
from deltafs.testing.checkpoints import run_cli


def test_largest_version_is_listed_logged_and_verified(tmp_path, maker):
    url = str(tmp_path / "store")
    push(url, maker.write(), version=MAX_VERSION)
    repo = Repository.open(url)
    assert repo.versions() == [MAX_VERSION] and repo.head().version == MAX_VERSION
    proc = run_cli("log", url)
    assert proc.returncode == 0 and str(MAX_VERSION) in proc.stdout, (proc.stdout, proc.stderr)
    assert run_cli("verify", url, "--all").returncode == 0


def test_other_spellings_are_strays_not_silently_skipped(tmp_path, maker):
    url = str(tmp_path / "store")
    push(url, maker.write())
    manifests = os.path.join(url, "manifests")
    shutil.copy(os.path.join(url, manifest_key(1)), os.path.join(manifests, "v00000000001.json"))  # 11 digits
    shutil.copy(os.path.join(url, manifest_key(1)), os.path.join(manifests, "v10000000000.json"))  # out of range
    versions, strays = Repository.open(url).list_manifests()
    assert versions == [1]
    assert strays == ["manifests/v00000000001.json", "manifests/v10000000000.json"]


ODD_STATS = [
    {"full_bytes": "x", "chunk_bytes_stored": None, "elements_total": -5, "elements_changed": None,
     "since_full": "y", "chain_bytes": "z", "chunks_total": 1.5},
    # Beyond any real count: `log` divided them as floats (OverflowError, exit 1; adversarial pass).
    {"full_bytes": 10**400, "chunk_bytes_stored": 10**400, "elements_total": 2**63, "elements_changed": 10**400,
     "since_full": 10**30, "chain_bytes": 2**64, "chunks_total": 10**400},
]


@pytest.mark.parametrize("odd", ODD_STATS)
def test_odd_stats_of_another_writer_do_not_break_log_or_push(tmp_path, maker, odd):
    """Stats are informative (FORMAT.md): a manifest whose counts are null, strings, negative or beyond any real count
    (another writer, a hand edit, re-sealed) made `log` and every ordinary push fail with an internal error, exit 1
    (adversarial passes). They read as absent now: log shows the version, the push goes on, and what it pulls is
    right."""
    import dataclasses
    import json

    from deltafs.format.records import Head

    url = str(tmp_path / "store")
    push(url, maker.write())
    push(url, maker.write())
    repo = Repository.open(url)
    man = repo.manifest(2)
    bad = dataclasses.replace(man, stats=odd).seal()
    with open(os.path.join(url, manifest_key(2)), "wb") as fh:
        fh.write(bad.encode())
    with open(os.path.join(url, "HEAD"), "wb") as fh:
        fh.write(Head(2, bad.digest).to_bytes())
    proc = run_cli("log", url, "--json")
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout)["versions"][1]
    assert row["version"] == 2 and row["full_bytes"] == man.raw_bytes and row["changed_fraction"] == 0.0
    assert run_cli("log", url).returncode == 0
    src = maker.write()
    proc = run_cli("push", src, url)
    assert proc.returncode == 0 and "version 3 (delta)" in proc.stdout, (proc.stdout, proc.stderr)
    assert Repository.open(url).manifest(3).stats["since_full"] == 1
    dest = str(tmp_path / "dest")
    assert run_cli("pull", url, dest).returncode == 0
    assert run_cli("verify", url, "--all").returncode == 0
    from deltafs.testing.checkpoints import files_of

    assert files_of(dest) == files_of(src)
