"""A store of format v2 manifests (written before packs, at d4f1857; kept in tests/data/v2_store) still pulls and
verifies, and takes format 3 pushes on top."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from deltafs.maintenance.verify import verify
from deltafs.publish import push
from deltafs.read.pull import local_version, pull
from deltafs.store.repo import Repository
from deltafs.testing.checkpoints import file_digests

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "v2_store")
EXPECTED = json.load(open(os.path.join(DATA, "expected_sha256.json")))


@pytest.fixture
def v2_store(tmp_path):
    path = tmp_path / "store"
    shutil.copytree(os.path.join(DATA, "store"), path)
    return str(path)


def test_every_v2_version_pulls_byte_exact_and_verifies(tmp_path, v2_store):
    repo = Repository.open(v2_store)
    assert repo.config.format_version == 2 and repo.versions() == [1, 2, 3, 4]
    assert {repo.manifest(v).format_version for v in repo.versions()} == {2}
    assert verify(v2_store, all_versions=True, deep=True).ok
    for v in repo.versions():
        dest = tmp_path / f"cold{v}"
        res = pull(v2_store, str(dest), version=v)
        assert res.version == v
        assert file_digests(dest) == EXPECTED[str(v)]
        assert verify(v2_store, local=str(dest)).ok


def test_v2_update_pull_and_a_v3_push_on_top(tmp_path, v2_store):
    dest = tmp_path / "dest"
    pull(v2_store, str(dest), version=2)
    res = pull(v2_store, str(dest))  # 2 -> 4 as deltas over a v2 local base
    assert res.version == 4 and not res.fallback and not res.from_full
    assert file_digests(dest) == EXPECTED["4"]
    # This release pushes format 3 manifests (packed small chunks) into the v2 store; the next pull applies one
    # over the v2 base.
    src = tmp_path / "src"
    shutil.copytree(local_version(str(dest)).path, src)
    (src / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 48, "edited": true}\n')
    pushed = push(v2_store, str(src), cache_dir=str(tmp_path / "cache"))
    assert pushed.version == 5
    assert Repository.open(v2_store).manifest(5).format_version == 3
    res = pull(v2_store, str(dest))
    assert res.version == 5 and not res.fallback
    assert file_digests(dest) == file_digests(src)
    assert verify(v2_store, all_versions=True, deep=True).ok
