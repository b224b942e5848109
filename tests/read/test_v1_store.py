"""A store written by the previous release (format v1, kept in tests/data/v1_store) still pulls and verifies."""

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

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "v1_store")
EXPECTED = json.load(open(os.path.join(DATA, "expected_sha256.json")))


@pytest.fixture
def v1_store(tmp_path):
    path = tmp_path / "store"
    shutil.copytree(os.path.join(DATA, "store"), path)
    return str(path)


def test_every_v1_version_pulls_byte_exact_and_verifies(tmp_path, v1_store):
    repo = Repository.open(v1_store)
    assert repo.config.format_version == 1 and repo.versions() == [1, 2, 3, 4]
    assert verify(v1_store, all_versions=True).ok
    for v in repo.versions():
        dest = tmp_path / f"cold{v}"
        res = pull(v1_store, str(dest), version=v)
        assert res.version == v
        assert file_digests(dest) == EXPECTED[str(v)]
        assert verify(v1_store, local=str(dest)).ok


def test_v1_update_pull_and_a_v2_push_on_top(tmp_path, v1_store):
    dest = tmp_path / "dest"
    pull(v1_store, str(dest), version=2)
    res = pull(v1_store, str(dest))  # 2 -> 4 as deltas over a v1 local base
    assert res.version == 4 and not res.fallback and not res.from_full
    assert file_digests(dest) == EXPECTED["4"]
    # This release pushes format 3 manifests into the v1 store; the next pull applies one over the v1 base.
    src = tmp_path / "src"
    shutil.copytree(local_version(str(dest)).path, src)
    (src / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 48, "edited": true}\n')
    pushed = push(v1_store, str(src), cache_dir=str(tmp_path / "cache"))
    assert pushed.version == 5
    assert Repository.open(v1_store).manifest(5).format_version == 3
    res = pull(v1_store, str(dest))
    assert res.version == 5 and not res.fallback
    assert file_digests(dest) == file_digests(src)
    assert verify(v1_store, all_versions=True).ok


def test_a_dest_pulled_by_0_1_is_still_ours(tmp_path, v1_store):
    """A DEST whose state record 0.1 wrote is recognized and updated, not refused as foreign (exit 9)."""
    from deltafs.read.dest import LocalCheckpoint

    dest = str(tmp_path / "dest")
    pull(v1_store, dest, version=1)
    state_file = os.path.realpath(dest) + ".json"
    raw = json.loads(open(state_file).read())
    # Exactly the keys and format name 0.1's deltafs/local.py wrote (no file stamps, isoformat time).
    old = {k: raw[k] for k in ("digest", "manifest", "store_id", "store_url", "version")}
    old.update({"format": "deltafs.local", "installed": "2026-12-01T02:15:49.991253+00:00"})
    with open(state_file, "w") as fh:
        fh.write(json.dumps(old, sort_keys=True, separators=(",", ":")))
    assert LocalCheckpoint(dest).state() is not None
    assert pull(v1_store, dest).version == 4
