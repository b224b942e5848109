"""The object-store conformance suite: what every ObjectStore must do.

Subclass StoreSuite in a test module and implement make_store() to return a fresh, empty store;
pytest collects the subclass (name it Test…). Tests of a guarantee the backend does not claim in
its capabilities are skipped, so a weaker backend passes by saying what it is.

    class TestMyStore(StoreSuite):
        def make_store(self):
            return open_objects("myproto://bucket/" + uuid.uuid4().hex)
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterator

import pytest

from deltafs.errors import FormatError, ObjectNotFoundError
from deltafs.store.base import ObjectStore


class StoreSuite:
    """Base class of the conformance tests; large_object_bytes may be lowered for slow backends."""

    large_object_bytes = 24 << 20
    racers = 8

    def make_store(self) -> ObjectStore:
        raise NotImplementedError

    @pytest.fixture
    def store(self) -> Iterator[ObjectStore]:
        yield self.make_store()

    # --- single objects ---------------------------------------------------------------------
    def test_put_then_get_returns_same_bytes(self, store: ObjectStore) -> None:
        data = bytes(range(256)) * 7 + b"\x00\xff\x00"
        store.put("blob", data)
        assert store.get("blob") == data
        assert store.size("blob") == len(data)
        assert store.exists("blob")

    def test_stat_gives_size_and_a_recent_mtime(self, store: ObjectStore) -> None:
        before = time.time()
        store.put("chunks/aa/x", b"12345")
        size, mtime = store.stat("chunks/aa/x")
        assert size == 5
        if mtime is not None:  # a backend without timestamps says None
            assert before - 120 < mtime < time.time() + 120
        with pytest.raises(ObjectNotFoundError):
            store.stat("chunks/aa/missing")

    def test_get_with_a_limit_refuses_larger_objects(self, store: ObjectStore) -> None:
        # Control files are read with a size limit: a huge or endless object is refused, not read whole.
        store.put("HEAD", b"x" * 100)
        assert store.get("HEAD", limit=100) == b"x" * 100
        with pytest.raises(FormatError, match="larger than the 99 bytes"):
            store.get("HEAD", limit=99)
        with pytest.raises(ObjectNotFoundError):
            store.get("missing", limit=10)

    def test_capabilities_are_consistent(self, store: ObjectStore) -> None:
        caps = store.capabilities
        assert caps.concurrency >= 1
        if caps.file_events:  # events come from directories of a store on this machine
            assert store.local_root is not None
            store.put("HEAD", b"1")
            assert store.event_dirs() and all(os.path.isdir(d) for d in store.event_dirs())
        else:
            assert store.event_dirs() == []
        assert store.leftovers(older_than=0.0) == {}  # nothing was interrupted here

    def test_empty_object(self, store: ObjectStore) -> None:
        store.put("empty", b"")
        assert store.get("empty") == b""
        assert store.size("empty") == 0
        assert store.exists("empty")

    def test_put_overwrites(self, store: ObjectStore) -> None:
        store.put("HEAD", b"one")
        store.put("HEAD", b"two")
        assert store.get("HEAD") == b"two"

    def test_missing_key_raises_not_found_naming_the_key(self, store: ObjectStore) -> None:
        with pytest.raises(ObjectNotFoundError, match="no/such/key") as info:
            store.get("no/such/key")
        assert isinstance(info.value, FileNotFoundError)
        with pytest.raises(ObjectNotFoundError):
            store.size("no/such/key")
        assert not store.exists("no/such/key")

    def test_nested_keys(self, store: ObjectStore) -> None:
        keys = ["chunks/ab/ab" + "0" * 62, "manifests/v0000000001.json", "a/b/c/d/e/f"]
        for i, key in enumerate(keys):
            store.put(key, f"value {i}".encode())
        for i, key in enumerate(keys):
            assert store.get(key) == f"value {i}".encode()
        # A folder-like prefix is not an object.
        assert not store.exists("a/b/c")
        with pytest.raises(ObjectNotFoundError):
            store.get("a/b/c")

    def test_large_object(self, store: ObjectStore) -> None:
        data = os.urandom(self.large_object_bytes)
        store.put("big", data)
        got = store.get("big")
        assert len(got) == len(data)
        assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()

    # --- create-if-absent ----------------------------------------------------------------------
    def test_put_if_absent_first_writer_wins(self, store: ObjectStore) -> None:
        assert store.put_if_absent("manifests/v1", b"first") is True
        assert store.put_if_absent("manifests/v1", b"second") is False
        assert store.get("manifests/v1") == b"first"

    def test_put_if_absent_of_equal_bytes_already_there_is_not_this_calls_write(self, store: ObjectStore) -> None:
        """A content-addressed object already there (equal bytes: whoever wrote it) is "was there", never "written
        now": a push counts only the latter as its own, and gc may remove the former meanwhile. S3 and GCS answered
        "written now" on their 412 (adversarial pass: a version committed without a chunk gc had removed)."""
        assert store.put_if_absent("chunks/ab/" + "ab" * 32, b"chunk", equal_is_ours=False) is True
        assert store.put_if_absent("chunks/ab/" + "ab" * 32, b"chunk", equal_is_ours=False) is False

    def test_put_if_absent_race_has_exactly_one_winner(self, store: ObjectStore) -> None:
        if not store.capabilities.atomic_create:
            pytest.skip("backend does not claim atomic_create")
        for round_ in range(3):
            key = f"manifests/race{round_}"
            barrier = threading.Barrier(self.racers)
            results: dict[int, bool] = {}
            errors: list[BaseException] = []

            def racer(i: int, barrier: threading.Barrier = barrier, results: dict[int, bool] = results,
                      key: str = key, errors: list[BaseException] = errors) -> None:
                try:
                    barrier.wait(timeout=30)
                    results[i] = store.put_if_absent(key, f"writer {i}".encode() * 100)
                except BaseException as exc:  # surfaced below
                    errors.append(exc)

            threads = [threading.Thread(target=racer, args=(i,)) for i in range(self.racers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert not errors, errors
            winners = [i for i, won in results.items() if won]
            assert len(winners) == 1, f"round {round_}: winners {winners}"
            assert store.get(key) == f"writer {winners[0]}".encode() * 100

    # --- listing and deleting ----------------------------------------------------------------
    def test_list_under_prefix_is_recursive_sorted_and_exact(self, store: ObjectStore) -> None:
        for key in ["m/v2", "m/v1", "m/sub/x", "mm/other", "top"]:
            store.put(key, b"x")
        assert store.list("m") == ["m/sub/x", "m/v1", "m/v2"]
        assert store.list("m/") == ["m/sub/x", "m/v1", "m/v2"]
        assert store.list("mm") == ["mm/other"]
        assert store.list("nothing-here") == []

    def test_delete_is_idempotent(self, store: ObjectStore) -> None:
        store.put("chunks/aa/x", b"1")
        store.put("chunks/aa/y", b"2")
        store.delete("chunks/aa/x")
        store.delete("chunks/aa/x")
        store.delete("never/existed")
        assert not store.exists("chunks/aa/x")
        assert store.list("chunks") == ["chunks/aa/y"]

    # --- batches --------------------------------------------------------------------------------
    def test_put_many_and_get_many(self, store: ObjectStore) -> None:
        items = {f"chunks/{i:02x}/{i:064x}": os.urandom(1000 + i) for i in range(64)}
        assert store.put_many(items) == {k: True for k in items}
        again = dict(list(items.items())[:5])
        again["chunks/ff/new"] = b"new"
        written = store.put_many({k: b"changed" if k != "chunks/ff/new" else v for k, v in again.items()})
        assert written == {**{k: False for k in list(items)[:5]}, "chunks/ff/new": True}
        got = store.get_many(list(items) + ["chunks/ff/new"])
        assert got == {**items, "chunks/ff/new": b"new"}
        assert store.get_many([]) == {}

    def test_put_many_overwrite(self, store: ObjectStore) -> None:
        store.put("a", b"old")
        assert store.put_many({"a": b"new", "b": b"b"}, if_absent=False) == {"a": True, "b": True}
        assert store.get_many(["a", "b"]) == {"a": b"new", "b": b"b"}

    def test_get_many_missing_key_raises(self, store: ObjectStore) -> None:
        store.put("present", b"1")
        with pytest.raises(ObjectNotFoundError, match="absent"):
            store.get_many(["present", "absent"])

    def test_put_many_race_has_one_winner_per_key(self, store: ObjectStore) -> None:
        if not store.capabilities.atomic_create:
            pytest.skip("backend does not claim atomic_create")
        keys = [f"manifests/v{i}" for i in range(16)]
        barrier = threading.Barrier(4)
        outcomes: list[dict[str, bool]] = []

        def writer(w: int) -> None:
            barrier.wait(timeout=30)
            outcomes.append(store.put_many({k: f"{w}".encode() for k in keys}))

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert len(outcomes) == 4
        for k in keys:
            assert sum(o[k] for o in outcomes) == 1, k

    # --- capabilities -----------------------------------------------------------------------------
    def test_atomic_put_readers_never_see_a_partial_object(self, store: ObjectStore) -> None:
        if not store.capabilities.atomic_put:
            pytest.skip("backend does not claim atomic_put")
        size = 2 << 20
        store.put("HEAD", b"a" * size)
        stop = threading.Event()
        seen: list[bytes] = []

        def writer() -> None:
            n = 0
            while not stop.is_set():
                store.put("HEAD", (b"b" if n % 2 else b"a") * size)
                n += 1

        t = threading.Thread(target=writer)
        t.start()
        try:
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                data = store.get("HEAD")
                seen.append(data[:1])
                assert len(data) == size and data.count(data[:1]) == size, "a reader saw a torn object"
        finally:
            stop.set()
            t.join(timeout=60)
        assert seen

    def test_referenced_get_waits_for_a_late_object(self, store: ObjectStore) -> None:
        # A store that says writes may become visible late must wait for referenced keys;
        # declare that of this backend and let the object appear while the reader waits.
        store.declare(read_after_write=False)
        timer = threading.Timer(0.4, lambda: store.put("manifests/late", b"here"))
        timer.start()
        try:
            with pytest.raises(ObjectNotFoundError):
                store.get("manifests/late")  # an unreferenced read does not wait
            assert store.get("manifests/late", referenced=True) == b"here"
        finally:
            timer.join()
        timer = threading.Timer(0.4, lambda: store.put("chunks/late", b"chunk"))
        timer.start()
        try:
            assert store.get_many(["manifests/late", "chunks/late"], referenced=True)["chunks/late"] == b"chunk"
        finally:
            timer.join()

    def test_referenced_get_gives_up_after_the_visibility_timeout(self, store: ObjectStore) -> None:
        from dataclasses import replace

        store.declare(read_after_write=False)
        store.retry = replace(store.retry, visibility_timeout=0.5)
        started = time.monotonic()
        with pytest.raises(ObjectNotFoundError):
            store.get("never", referenced=True)
        assert 0.4 < time.monotonic() - started < 10

    def test_consistent_store_does_not_wait_for_missing_keys(self, store: ObjectStore) -> None:
        if not store.capabilities.read_after_write:
            pytest.skip("backend does not claim read_after_write")
        started = time.monotonic()
        with pytest.raises(ObjectNotFoundError):
            store.get("never", referenced=True)
        assert time.monotonic() - started < 2
