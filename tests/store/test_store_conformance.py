"""The conformance suite against every backend we ship: a local path, memory:// and s3:// (moto)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from deltafs.store.base import ObjectStore
from deltafs.store.local import LocalObjectStore
from deltafs.store.memory import MemoryObjectStore
from deltafs.store.open import open_objects
from deltafs.store.s3 import S3ObjectStore
from deltafs.testing.store_suite import StoreSuite


class TestLocalStore(StoreSuite):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[ObjectStore]:
        store = open_objects(str(tmp_path / "store"))
        assert isinstance(store, LocalObjectStore)
        yield store

    def test_temp_files_are_not_listed(self, store: ObjectStore, tmp_path: Path) -> None:
        store.put("chunks/aa/x", b"1")
        (tmp_path / "store" / "chunks" / "aa" / ".tmp-deadbeef").write_bytes(b"partial")
        assert store.list("chunks") == ["chunks/aa/x"]

    def test_file_url_is_the_same_store(self, tmp_path: Path) -> None:
        open_objects(str(tmp_path / "s")).put("k", b"v")
        assert open_objects(f"file://{tmp_path}/s").get("k") == b"v"


class TestMemoryStore(StoreSuite):
    @pytest.fixture
    def store(self) -> Iterator[ObjectStore]:
        store = open_objects(f"memory://deltafs-tests/{uuid.uuid4().hex}")
        assert isinstance(store, MemoryObjectStore)
        yield store


class TestS3Store(StoreSuite):
    large_object_bytes = 12 << 20

    @pytest.fixture
    def store(self, s3_url: str, s3_options: dict[str, Any]) -> Iterator[ObjectStore]:
        store = open_objects(s3_url, s3_options)
        assert isinstance(store, S3ObjectStore)
        assert store.capabilities.atomic_create, "moto honours If-None-Match; the flag must say so"
        yield store

    def test_conditional_create_is_enforced_by_the_server(self, store: ObjectStore, s3_server: Any,
                                                          s3_bucket: str) -> None:
        # Not check-then-write on our side: a second create through a plain boto3 client with
        # If-None-Match is refused by the server after deltafs wrote the key.
        from botocore.exceptions import ClientError

        assert store.put_if_absent("manifests/v0000000001.json", b"ours")
        key = f"{store.root.split('/', 1)[1]}/manifests/v0000000001.json"
        with pytest.raises(ClientError, match="PreconditionFailed|412"):
            s3_server.client().put_object(Bucket=s3_bucket, Key=key, Body=b"theirs", IfNoneMatch="*")
        assert store.get("manifests/v0000000001.json") == b"ours"

    def test_multipart_create_if_absent(self, store: ObjectStore) -> None:
        # Above 100 MB s3fs switches to a multipart upload; the precondition rides on its completion.
        big = b"\x01" * (101 << 20)
        assert store.put_if_absent("big", big) is True
        assert store.put_if_absent("big", b"\x02" * (101 << 20)) is False
        assert store.size("big") == len(big)
