"""A small typed object-store layer over fsspec: get, put, put_if_absent, list, delete.

fsspec stays inside this package. Correctness never rests on fsspec transactions: objects are
immutable and content-addressed, and a version commits through one create-if-absent write.
"""

from __future__ import annotations

import errno
import os
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import fsspec

from deltafs.errors import ObjectNotFoundError, StoreError


@dataclass(frozen=True)
class Capabilities:
    """What a backend guarantees; FORMAT.md's per-backend table is written from these."""

    atomic_put: bool  # a reader never sees a partially written object
    atomic_create: bool  # put_if_absent cannot let two writers both win
    durable: bool  # a successful put has been flushed to stable storage


class ObjectStore:
    """Bytes under string keys below one root URL."""

    capabilities = Capabilities(atomic_put=False, atomic_create=False, durable=False)

    def __init__(self, fs: Any, root: str, url: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url

    def path(self, key: str) -> str:
        return f"{self.root}/{key}" if self.root else key

    def get(self, key: str) -> bytes:
        try:
            return bytes(self.fs.cat_file(self.path(key)))
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{key} not found in {self.url}") from None
        except OSError as exc:
            raise StoreError(f"cannot read {key} from {self.url}: {exc}") from exc

    def get_many(self, keys: list[str]) -> dict[str, bytes]:
        """Fetch several objects; a missing one raises ObjectNotFoundError."""
        return {k: self.get(k) for k in keys}

    def put(self, key: str, data: bytes) -> None:
        try:
            self.fs.pipe_file(self.path(key), data)
        except OSError as exc:
            raise StoreError(f"cannot write {key} to {self.url}: {exc}") from exc

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Write only if nothing is there; True when this call created the object."""
        if self.exists(key):
            return False
        self.put(key, data)
        return True

    def exists(self, key: str) -> bool:
        try:
            return bool(self.fs.exists(self.path(key)))
        except OSError as exc:
            raise StoreError(f"cannot reach {self.url}: {exc}") from exc

    def size(self, key: str) -> int:
        try:
            return int(self.fs.size(self.path(key)))
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{key} not found in {self.url}") from None

    def list(self, prefix: str) -> list[str]:
        """Keys under a folder-like prefix, recursively, sorted."""
        base = self.path(prefix.rstrip("/"))
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise StoreError(f"cannot list {prefix} in {self.url}: {exc}") from exc
        root = self.root + "/" if self.root else ""
        keys = []
        for p in found:
            p = p if not root or p.startswith(root) else "/" + p  # memory fs drops the leading slash
            keys.append(p[len(root):] if root and p.startswith(root) else p)
        return sorted(keys)

    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self.path(key))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StoreError(f"cannot delete {key} from {self.url}: {exc}") from exc


class LocalObjectStore(ObjectStore):
    """A local or network-mounted directory, written with temp file + fsync + rename."""

    capabilities = Capabilities(atomic_put=True, atomic_create=True, durable=True)

    def get(self, key: str) -> bytes:
        try:
            with open(self.path(key), "rb") as fh:
                return fh.read()
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{key} not found in {self.url}") from None
        except IsADirectoryError:
            raise ObjectNotFoundError(f"{key} not found in {self.url}") from None
        except OSError as exc:
            raise StoreError(f"cannot read {key} from {self.url}: {exc}") from exc

    def _write_temp(self, key: str, data: bytes) -> str:
        final = self.path(key)
        directory = os.path.dirname(final)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".tmp-{uuid.uuid4().hex}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        return tmp

    def _fsync_dir(self, key: str) -> None:
        fd = os.open(os.path.dirname(self.path(key)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def put(self, key: str, data: bytes) -> None:
        try:
            tmp = self._write_temp(key, data)
            os.replace(tmp, self.path(key))
            self._fsync_dir(key)
        except OSError as exc:
            raise StoreError(f"cannot write {key} to {self.url}: {exc}") from exc

    def put_if_absent(self, key: str, data: bytes) -> bool:
        # link(2) fails with EEXIST if the name is taken: an atomic create of a complete file.
        try:
            tmp = self._write_temp(key, data)
            try:
                os.link(tmp, self.path(key))
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
            self._fsync_dir(key)
            return True
        except OSError as exc:
            if exc.errno == errno.EEXIST:
                return False
            raise StoreError(f"cannot write {key} to {self.url}: {exc}") from exc

    def exists(self, key: str) -> bool:
        return os.path.isfile(self.path(key))

    def list(self, prefix: str) -> list[str]:
        base = self.path(prefix.rstrip("/"))
        keys = []
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                if name.startswith(".tmp-"):
                    continue
                full = os.path.join(dirpath, name)
                keys.append(os.path.relpath(full, self.root).replace(os.sep, "/"))
        return sorted(keys)

    def delete(self, key: str) -> None:
        try:
            os.unlink(self.path(key))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StoreError(f"cannot delete {key} from {self.url}: {exc}") from exc


class MemoryObjectStore(ObjectStore):
    """fsspec's memory:// filesystem; process-local, so a lock makes create-if-absent atomic."""

    capabilities = Capabilities(atomic_put=True, atomic_create=True, durable=False)
    _lock = threading.Lock()

    def put_if_absent(self, key: str, data: bytes) -> bool:
        with self._lock:
            return super().put_if_absent(key, data)
