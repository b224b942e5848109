"""What the fsspec-based backends (memory, s3, gcs, any other fsspec protocol) share."""

from __future__ import annotations

from typing import Any

from deltafs.store.base import Capabilities, ObjectStore, RetryPolicy, _Kind, _timestamp


class FsspecObjectStore(ObjectStore):
    """An fsspec filesystem under one root path; for protocols without a backend of their own it is the whole store."""

    capabilities = Capabilities(atomic_put=False, atomic_create=False)

    def __init__(self, fs: Any, root: str, url: str, *, retry: RetryPolicy | None = None,
                 max_workers: int | None = None) -> None:
        super().__init__(url, retry=retry, max_workers=max_workers)
        self.fs = fs
        self.root = root.rstrip("/")

    def path(self, key: str) -> str:
        return f"{self.root}/{key}" if self.root else key

    def deadline(self) -> dict[str, float]:
        """fsspec's `timeout` keyword for one call of an async filesystem (its sync wrapper then abandons the call
        after RetryPolicy.request_timeout seconds: FSTimeoutError, a TimeoutError, retried as transient); {} for a
        synchronous one or no limit."""
        seconds = self.retry.request_timeout
        return {"timeout": seconds} if seconds and getattr(self.fs, "async_impl", False) else {}

    def _read(self, key: str, limit: int | None) -> bytes:
        if limit is None:
            return bytes(self.fs.cat_file(self.path(key), **self.deadline()))
        return bytes(self.fs.cat_file(self.path(key), start=0, end=limit + 1, **self.deadline()))

    def _write(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(self.path(key), data, **self.deadline())

    def _isfile(self, key: str) -> bool:
        # isfile, not exists: on object stores a key prefix looks like a directory.
        return bool(self.fs.isfile(self.path(key), **self.deadline()))

    def _stat(self, key: str) -> tuple[int, float | None]:
        info = self.fs.info(self.path(key), **self.deadline())
        if info.get("type") == "directory":
            raise FileNotFoundError(key)
        return int(info.get("size") or 0), _timestamp(info)

    def _find(self, prefix: str) -> list[str]:
        try:
            found = list(self.fs.find(self.path(prefix.rstrip("/"))))
        except FileNotFoundError as exc:
            if self._kind(exc) is _Kind.NO_BUCKET:
                raise
            return []
        root = self.root + "/" if self.root else ""
        keys = []
        for p in found:
            p = p if not root or p.startswith(root) else "/" + p  # memory fs drops the leading slash
            keys.append(p[len(root):] if root and p.startswith(root) else p)
        return keys

    def _remove(self, key: str) -> None:
        self.fs.rm_file(self.path(key), **self.deadline())
