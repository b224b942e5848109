"""Bad stores give one clear deltafs error quickly, and flaky ones are retried, never hung on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from typing import Any, Iterator

import pytest

from deltafs.errors import ObjectNotFoundError, StoreError, StoreNotFoundError, UsageError
from deltafs.store.open import open_objects
from deltafs.store.repo import Repository
from deltafs.testing.s3server import (
    ACCESS_KEY,
    SECRET_KEY,
    FlakyProxy,
    S3Server,
    hanging_endpoint,
    start_process_server,
)

FAST = {"attempts": 3, "base_delay": 0.05, "max_delay": 0.2}


@pytest.fixture
def process_server() -> Iterator[S3Server]:
    """A moto server in its own process: it can be killed, and its auth settings are its own."""
    server = start_process_server()
    yield server
    server.stop()


def test_missing_bucket_is_a_clear_error(s3_server: S3Server, s3_options: dict[str, Any]) -> None:
    url = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run1"
    store = open_objects(url, s3_options)
    for call in (lambda: store.get("HEAD"), lambda: store.put("HEAD", b"x"), lambda: store.list("manifests"),
                 lambda: store.put_if_absent("k", b"x"), lambda: store.get_many(["a", "b"])):
        with pytest.raises(StoreNotFoundError, match="does not exist: create it or fix the URL"):
            call()
    with pytest.raises(StoreNotFoundError, match="no-such-bucket"):
        Repository.open(url, s3_options, create=True)


def test_wrong_credentials_fail_at_once_with_a_hint(process_server: S3Server) -> None:
    bucket = process_server.make_bucket()
    process_server.enable_auth()
    store = open_objects(f"s3://{bucket}/run1", process_server.storage_options(key="wrong", secret="wrong"))
    started = time.monotonic()
    for call in (lambda: store.get("HEAD"), lambda: store.put("HEAD", b"x"), lambda: store.exists("HEAD"),
                 lambda: store.list("manifests"), lambda: store.put_many({"a": b"1", "b": b"2"})):
        with pytest.raises(StoreError, match=f"access denied to s3://{bucket}/run1: check credentials"):
            call()
    assert time.monotonic() - started < 10, "a permanent error must not be retried"


def test_closed_port_fails_after_bounded_retries() -> None:
    from deltafs.testing.s3server import free_port

    url = f"http://127.0.0.1:{free_port()}"
    store = open_objects("s3://bucket/run1", {"key": ACCESS_KEY, "secret": SECRET_KEY, "endpoint_url": url,
                                              "deltafs": FAST})
    started = time.monotonic()
    with pytest.raises(StoreError, match="after 3 attempts"):
        store.get("HEAD")
    with pytest.raises(StoreError, match="after 3 attempts"):
        store.get_many(["a", "b", "c"])
    assert time.monotonic() - started < 30


def test_server_that_never_answers_times_out() -> None:
    url, listener = hanging_endpoint()
    try:
        store = open_objects("s3://bucket/run1", {
            "key": ACCESS_KEY, "secret": SECRET_KEY, "endpoint_url": url,
            "config_kwargs": {"connect_timeout": 1, "read_timeout": 1}, "deltafs": {**FAST, "attempts": 2},
        })
        started = time.monotonic()
        with pytest.raises(StoreError, match="after 2 attempts"):
            store.get("HEAD")
        assert time.monotonic() - started < 20
    finally:
        listener.close()


def test_server_that_dies_mid_way(process_server: S3Server) -> None:
    bucket = process_server.make_bucket()
    store = open_objects(f"s3://{bucket}/run1", process_server.storage_options(deltafs=FAST))
    items = {f"chunks/{i:02x}/{i}": os.urandom(4096) for i in range(20)}
    store.put_many(items)
    assert store.get_many(list(items)) == items
    process_server.stop()
    started = time.monotonic()
    with pytest.raises(StoreError, match="after 3 attempts"):
        store.get_many(list(items))
    with pytest.raises(StoreError):
        store.put_if_absent("manifests/v0000000002.json", b"{}")
    assert time.monotonic() - started < 30


def test_dropped_connections_are_retried(s3_server: S3Server, s3_url: str, s3_options: dict[str, Any]) -> None:
    data = os.urandom(300_000)
    open_objects(s3_url, s3_options).put("chunks/aa/blob", data)
    proxy = FlakyProxy(s3_server.endpoint_url, drop=2)
    try:
        store = open_objects(s3_url, {**s3_options, "endpoint_url": proxy.endpoint_url, "deltafs": FAST})
        assert store.get("chunks/aa/blob") == data
        assert proxy.connections >= 3
    finally:
        proxy.close()


def test_transfers_cut_mid_way_are_retried_and_complete(s3_server: S3Server, s3_url: str,
                                                         s3_options: dict[str, Any]) -> None:
    items = {f"chunks/{i:02x}/c{i}": os.urandom(200_000) for i in range(4)}
    open_objects(s3_url, s3_options).put_many(items)
    proxy = FlakyProxy(s3_server.endpoint_url, cut=2, cut_after=50_000)
    try:
        store = open_objects(s3_url, {**s3_options, "endpoint_url": proxy.endpoint_url,
                                      "deltafs": {**FAST, "attempts": 5}})
        assert store.get_many(list(items)) == items
        assert store.get("chunks/00/c0") == items["chunks/00/c0"]
        assert proxy.connections >= 3  # two were cut, so the data came through retries
    finally:
        proxy.close()


def test_a_server_that_keeps_dropping_gives_up(s3_server: S3Server, s3_url: str, s3_options: dict[str, Any]) -> None:
    proxy = FlakyProxy(s3_server.endpoint_url, drop=1000)
    try:
        store = open_objects(s3_url, {**s3_options, "endpoint_url": proxy.endpoint_url, "deltafs": FAST})
        with pytest.raises(StoreError, match="after 3 attempts"):
            store.put("HEAD", b"x")
    finally:
        proxy.close()


def test_backend_not_installed_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    # As on a host without the extra: importing gcsfs fails. (s3 is checked in a fresh process in
    # tests/core/test_cli.py: fsspec caches a backend class once it has been imported.)
    import deltafs.store.gcs

    monkeypatch.setitem(sys.modules, "gcsfs", None)
    monkeypatch.setitem(sys.modules, "gcsfs.core", None)
    monkeypatch.setattr(deltafs.store.gcs, "_FS_CLASS", None)  # as in a fresh process
    with pytest.raises(StoreError, match=r"pip install gcsfs \(deltafs's \[gcs\] extra\)") as info:
        open_objects("gs://bucket/run1")
    assert "\n" not in str(info.value)


def test_unknown_protocol() -> None:
    with pytest.raises(StoreError, match="nosuchproto://"):
        open_objects("nosuchproto://bucket/run1")


def test_bad_deltafs_options_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="unknown key.*retries"):
        open_objects("memory://x", {"deltafs": {"retries": 3}})
    with pytest.raises(UsageError, match="must be a JSON object"):
        open_objects("memory://x", {"deltafs": 3})



@pytest.mark.parametrize("key, value", [
    ("atomic_create", "false"), ("read_after_write", "False"), ("atomic_create", 0), ("read_after_write", "no"),
    ("attempts", 0), ("attempts", -3), ("attempts", 2.5), ("attempts", True), ("attempts", "3"),
    ("base_delay", 1e308), ("base_delay", float("nan")), ("request_timeout", -1), ("max_workers", 0),
])
def test_tuning_values_of_the_wrong_kind_or_out_of_range_are_refused(key: str, value: object) -> None:
    """The string "false" for atomic_create counted as true (a server that ignores If-None-Match still trusted);
    attempts 0, a negative request_timeout or max_workers 0 were taken and broke every call; base_delay 1e308 was
    an internal error (adversarial pass). Each is a usage error (exit 2) naming the key."""
    with pytest.raises(UsageError, match=f"storage option \"deltafs\": {key} must be"):
        open_objects("memory://x", {"deltafs": {key: value}})


def test_tuning_flags_take_json_booleans() -> None:
    store = open_objects("memory://flags", {"deltafs": {"atomic_create": False, "read_after_write": False}})
    assert store.capabilities.atomic_create is False and store.capabilities.read_after_write is False


def test_storage_option_declares_an_eventually_consistent_store(tmp_path: Any) -> None:
    store = open_objects(str(tmp_path), {"deltafs": {"read_after_write": False, "visibility_timeout": 0.3}})
    assert store.capabilities.read_after_write is False
    started = time.monotonic()
    with pytest.raises(ObjectNotFoundError):
        store.get("manifests/v0000000001.json", referenced=True)
    assert time.monotonic() - started >= 0.3


_ENV_SCRIPT = """
import sys
from deltafs.store.open import open_objects
store = open_objects(sys.argv[1])
store.put("HEAD", b"from env")
print(store.get("HEAD").decode())
"""


@pytest.mark.parametrize("style", ["aws", "fsspec"])
def test_environment_configuration(s3_server: S3Server, s3_url: str, style: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FSSPEC_"))}
    if style == "aws":  # botocore's own variables
        env.update(AWS_ENDPOINT_URL=s3_server.endpoint_url, AWS_ACCESS_KEY_ID=ACCESS_KEY,
                   AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_DEFAULT_REGION="us-east-1")
    else:  # fsspec's configuration variables, FSSPEC_<PROTOCOL>_<OPTION>
        env.update(FSSPEC_S3=json.dumps({"endpoint_url": s3_server.endpoint_url, "key": ACCESS_KEY,
                                         "secret": SECRET_KEY}), AWS_DEFAULT_REGION="us-east-1")
    out = subprocess.run([sys.executable, "-c", _ENV_SCRIPT, s3_url], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "from env"


def test_conditional_create_whose_reply_was_lost_is_still_ours(s3_server: S3Server, s3_url: str,
                                                                 s3_options: dict[str, Any]) -> None:
    # The server stores the object, then the connection breaks in the middle of its answer (after the
    # 25-byte "100 Continue"); the resent PUT gets 412. The stored bytes are ours, so put_if_absent
    # must report True, not a conflict.
    proxy = FlakyProxy(s3_server.endpoint_url, cut=1, cut_after=60)
    try:
        store = open_objects(s3_url, {**s3_options, "endpoint_url": proxy.endpoint_url, "deltafs": FAST})
        assert store.put_if_absent("manifests/v0000000001.json", b"ours") is True
        assert proxy.connections >= 2
        assert store.get("manifests/v0000000001.json") == b"ours"
    finally:
        proxy.close()
    other = FlakyProxy(s3_server.endpoint_url, cut=1, cut_after=60)
    try:
        store = open_objects(s3_url, {**s3_options, "endpoint_url": other.endpoint_url, "deltafs": FAST})
        assert store.put_if_absent("manifests/v0000000001.json", b"theirs") is False
    finally:
        other.close()


def test_uploads_to_a_server_that_stops_answering_time_out(s3_server: S3Server, s3_url: str,
                                                          s3_options: dict[str, Any]) -> None:
    """A PUT whose server stops answering (frozen, blackholed) waited forever: s3fs's read timeout does not cover
    a client waiting for "100 Continue". Every call now has a deadline (storage option request_timeout), past
    which it is a transient failure: retried, then exit 3 naming the key."""
    proxy = FlakyProxy(s3_server.endpoint_url, stall_puts_to=b"/chunks/")
    try:
        store = open_objects(s3_url, {**s3_options, "endpoint_url": proxy.endpoint_url,
                                      "deltafs": {**FAST, "attempts": 2, "request_timeout": 2}})
        store.put("HEAD", b"{}")  # what is not stalled goes through
        started = time.monotonic()
        with pytest.raises(StoreError, match="chunks/ab/blob.*after 2 attempts"):
            store.put("chunks/ab/blob", os.urandom(2 << 20))
        assert proxy.stalled == 2 and time.monotonic() - started < 30
    finally:
        proxy.close()


def test_request_timeout_is_a_deltafs_option() -> None:
    store = open_objects("memory://deadline", {"deltafs": {"request_timeout": 7.5}})
    assert store.retry.request_timeout == 7.5
    with pytest.raises(UsageError, match="request_timeout must be a number from 0 to 86400, not 'soon'"):
        open_objects("memory://deadline", {"deltafs": {"request_timeout": "soon"}})


@pytest.mark.parametrize("url", ["s3://bucket//run", "gs://bucket/a//b", "memory://x//y"])
def test_an_empty_path_component_in_a_store_url_is_refused(url: str) -> None:
    """s3://bkt//run pushed and pulled, but its keys began with "/": log showed no versions, gc and verify stopped."""
    with pytest.raises(UsageError, match="empty path component"):
        open_objects(url, {})


def test_a_manifest_stored_although_every_reply_to_its_create_was_lost_is_a_committed_push(tmp_path, maker,
                                                                                            monkeypatch):
    """The server stored the manifest, and every reply to its create (and to the retries) was lost: the push said
    "cannot write manifests/v...: connection closed", exit 3, for a version it had published, and pushing again
    published the step twice (adversarial pass, S3 and GCS behind a lossy proxy). One read of the key settles it."""
    from deltafs.format.keys import MANIFEST_PREFIX
    from deltafs.publish import push
    from deltafs.store.local import LocalObjectStore
    from deltafs.store.repo import Repository

    store = str(tmp_path / "store")
    push(store, maker.write())
    real = LocalObjectStore._create

    def reply_lost(self, key, data, equal_is_ours=True):
        created = real(self, key, data, equal_is_ours)
        if key.startswith(MANIFEST_PREFIX):
            raise ConnectionError("Connection was closed before the reply")  # whatever the server did
        return created

    monkeypatch.setattr(LocalObjectStore, "_create", reply_lost)
    maker.advance()
    res = push(store, maker.write(), storage_options={"deltafs": {"attempts": 2, "base_delay": 0.01}})
    monkeypatch.undo()
    assert res.version == 2 and Repository.open(store).versions() == [1, 2]
    assert Repository.open(store).head().version == 2


def test_a_manifest_create_that_failed_and_left_nothing_still_fails_the_push(tmp_path, maker, monkeypatch):
    from deltafs.format.keys import MANIFEST_PREFIX
    from deltafs.publish import push
    from deltafs.store.local import LocalObjectStore
    from deltafs.store.repo import Repository

    store = str(tmp_path / "store")
    push(store, maker.write())
    real = LocalObjectStore._create

    def refused(self, key, data, equal_is_ours=True):
        if key.startswith(MANIFEST_PREFIX):
            raise ConnectionError("Connection refused")
        return real(self, key, data, equal_is_ours)

    monkeypatch.setattr(LocalObjectStore, "_create", refused)
    maker.advance()
    with pytest.raises(StoreError, match="cannot write manifests/v0000000002.json"):
        push(store, maker.write(), storage_options={"deltafs": {"attempts": 2, "base_delay": 0.01}})
    monkeypatch.undo()
    assert Repository.open(store).versions() == [1]


def test_the_head_read_back_never_moves_another_writers_newer_head_back(tmp_path, maker, monkeypatch):
    """The read-back of HEAD (for servers that keep uploads damaged) took another writer's HEAD, written between
    this push's write and its read, for damage and wrote the older HEAD over it (review): only bytes that are no
    valid HEAD are damage."""
    import uuid

    from deltafs.format.manifest import Head
    from deltafs.publish import push
    from deltafs.store.repo import Repository

    url = f"memory://head-{uuid.uuid4().hex}"
    push(url, maker.write())
    repo = Repository.open(url)
    assert repo.objects.local_root is None  # read back, as a remote store
    real_put = type(repo.objects).put
    newer = Head(99, "sha256:" + "ab" * 32).to_bytes()

    def another_writer_right_after(self, key, data):
        real_put(self, key, data)
        if key == "HEAD":
            real_put(self, key, newer)

    monkeypatch.setattr(type(repo.objects), "put", another_writer_right_after)
    repo.advance_head(Head(2, "sha256:" + "cd" * 32))
    monkeypatch.undo()
    assert repo.objects.get("HEAD") == newer


@pytest.mark.parametrize("where", ["file", "under-a-file", "proc"])
def test_a_local_store_path_that_cannot_be_a_directory_says_so(tmp_path: Any, where: str) -> None:
    """A push to a store path that is a file, lies under one, or cannot be made (/proc/x) names the path and the
    reason (exit 3). It said "deltafs.json not found", as if the store were only missing its config."""
    (tmp_path / "afile").write_bytes(b"x")
    root = {"file": str(tmp_path / "afile"), "under-a-file": str(tmp_path / "afile" / "store"),
            "proc": "/proc/deltafs-no-such-dir"}[where]
    with pytest.raises(StoreError, match=f"cannot use {root} as a store directory: ") as err:
        Repository.open(root, create=True)
    assert "deltafs.json" not in str(err.value)
    assert (tmp_path / "afile").read_bytes() == b"x"
    if where == "file":  # and read: said as what it is, not "push to it first"
        with pytest.raises(StoreNotFoundError, match="it is not a directory"):
            Repository.open(root)
