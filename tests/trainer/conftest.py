from __future__ import annotations

import pytest

from deltafs.testing.checkpoints import CheckpointMaker


@pytest.fixture(autouse=True)
def _push_cache(tmp_path, monkeypatch):
    """Each test gets its own push cache, as a fresh trainer host would."""
    monkeypatch.setenv("DELTAFS_CACHE", str(tmp_path / "push-cache"))


@pytest.fixture
def maker(tmp_path):
    return CheckpointMaker(tmp_path / "src")
