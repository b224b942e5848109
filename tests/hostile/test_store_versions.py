"""The version lister misses no manifest: every key under manifests/ is a version or reported as a stray."""

from __future__ import annotations

import os
import shutil

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
