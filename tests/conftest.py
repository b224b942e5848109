"""Shared fixtures: a push cache per test, a checkpoint maker, one moto S3 server for the session, and a count of
the chunk objects a local store serves."""

from __future__ import annotations

import collections
import signal
import uuid
from typing import Any, Iterator

import pytest

from deltafs.testing.checkpoints import CheckpointMaker
from deltafs.testing.s3server import S3Server, start_thread_server

# A suite started with `cmd &` from a script (no job control) inherits SIGINT ignored, and Python then installs no
# KeyboardInterrupt handler; children inherit the ignore across exec. The tests that press Ctrl-C on a push or a pull
# need it delivered, so the suite restores Python's own handler (its children then start with the default action).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _push_cache(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test gets its own push cache, as a fresh trainer host would (and ~/.cache stays clean)."""
    monkeypatch.setenv("DELTAFS_CACHE", str(tmp_path / "push-cache"))


@pytest.fixture
def maker(tmp_path: Any) -> CheckpointMaker:
    """Successive versions of a small HF-like checkpoint directory."""
    return CheckpointMaker(tmp_path / "src")


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's standalone S3 server on 127.0.0.1, a free port, shared by the session."""
    server = start_thread_server()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_bucket(s3_server: S3Server) -> str:
    return s3_server.make_bucket()


@pytest.fixture
def s3_options(s3_server: S3Server) -> dict[str, Any]:
    """Storage options that reach the session server (pass them as --storage-options JSON too)."""
    return s3_server.storage_options()


@pytest.fixture
def s3_url(s3_bucket: str) -> str:
    """An empty s3:// store URL, unique to the test."""
    return f"s3://{s3_bucket}/{uuid.uuid4().hex}"


@pytest.fixture
def object_reads(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """How many times each chunk object (key `chunks/...`) is read from a local store during the test."""
    from deltafs.store.local import LocalObjectStore

    reads: collections.Counter[str] = collections.Counter()
    real_read = LocalObjectStore._read

    def counting_read(self: LocalObjectStore, key: str, limit: int | None) -> bytes:
        if key.startswith("chunks/"):
            reads[key] += 1
        return real_read(self, key, limit)

    monkeypatch.setattr(LocalObjectStore, "_read", counting_read)
    return reads
