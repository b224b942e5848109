"""S3 through s3fs: conditional create with If-None-Match, so two writers cannot claim one version.

AWS S3 has honoured `If-None-Match: *` on PutObject and CompleteMultipartUpload since August
2024 (HTTP 412 when the key exists); s3fs sends it for pipe_file(..., mode="create") and maps the
412 to FileExistsError. moto (5.x) honours it too, which the conformance suite checks with two
racing writers. A server that answers 501 NotImplemented to the header makes this store fall back
to check-then-write and drop its atomic_create flag. A server that silently ignores the header
cannot be detected: declare it with storage option {"deltafs": {"atomic_create": false}}.
"""

from __future__ import annotations

import errno
from typing import Any

from deltafs.store.base import Capabilities, _Kind, classify
from deltafs.store.fsspec import FsspecObjectStore


def _error_code(exc: BaseException) -> str:
    """The S3 error code ('NoSuchBucket', 'AccessDenied' …) behind an s3fs exception, if any."""
    for err in (exc, exc.__cause__, exc.__context__):
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            return str(response.get("Error", {}).get("Code", ""))
    return ""


class S3ObjectStore(FsspecObjectStore):
    """s3:// buckets (AWS, MinIO, moto, any S3-compatible server)."""

    # S3 has been strongly consistent for reads, overwrites and listings since December 2020.
    capabilities = Capabilities(atomic_put=True, atomic_create=True, read_after_write=True)
    default_workers = 32

    def _kind(self, exc: BaseException) -> _Kind | None:
        code = _error_code(exc)
        if code == "NoSuchBucket" or (isinstance(exc, FileNotFoundError) and "bucket does not exist" in str(exc)):
            return _Kind.NO_BUCKET
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken",
                    "InvalidToken", "AllAccessDisabled"):
            return _Kind.DENIED
        return classify(exc)

    # A plain GET: s3fs would otherwise HEAD every object first to decide on ranged reads.
    def _read(self, key: str, limit: int | None) -> bytes:
        if limit is not None:
            try:
                return super()._read(key, limit)  # a ranged GET
            except OSError as exc:
                # A range of an empty object cannot be served (416): the object holds no bytes, which the caller
                # judges (a truncated chunk is an integrity failure, exit 6), not an unreachable store.
                if _error_code(exc) == "InvalidRange" or (exc.errno == errno.EINVAL and "range" in str(exc).lower()):
                    return b""
                raise
        return bytes(self.fs.cat_file(self.path(key), max_concurrency=1, **self.deadline()))

    def _head(self, key: str) -> dict[str, Any]:
        bucket, name, _ = self.fs.split_path(self.path(key))
        return dict(self.fs.call_s3("head_object", Bucket=bucket, Key=name, **self.deadline()))

    def _isfile(self, key: str) -> bool:
        # One HEAD; s3fs's exists/isfile also list the prefix when the key is missing.
        try:
            self._head(key)
            return True
        except FileNotFoundError:
            return False

    def _stat(self, key: str) -> tuple[int, float | None]:
        head = self._head(key)
        modified = head.get("LastModified")
        return int(head["ContentLength"]), modified.timestamp() if modified is not None else None

    def _unsupported(self, exc: BaseException) -> bool:
        return _error_code(exc) == "NotImplemented" or getattr(exc, "errno", None) == errno.ENOSYS

    def _ours(self, key: str, data: bytes) -> bool:
        """After a 412: is the stored object our own write whose reply was lost?

        The HTTP client may resend a PUT on a new connection when the first one broke after the
        server had stored it (aiohttp retries idempotent requests; deltafs retries transient
        errors), and the resend is answered 412. Equal bytes mean the write was ours: manifests
        carry their creation time, so two writers never produce the same manifest bytes, and for
        content-addressed chunks equal bytes are the same chunk anyway.
        """
        return self._read(key, None) == data

    def _create(self, key: str, data: bytes, equal_is_ours: bool = True) -> bool:
        """Create key with If-None-Match: *; False when another writer's object is there."""
        if not self.capabilities.atomic_create:
            return super()._create(key, data, equal_is_ours)
        try:
            self.fs.pipe_file(self.path(key), data, mode="create", **self.deadline())
            return True
        except FileExistsError:
            return equal_is_ours and self._ours(key, data)
        except OSError as exc:
            if not self._unsupported(exc):
                raise
        self.declare(atomic_create=False)  # the server refused If-None-Match (501): check then write
        return super()._create(key, data, equal_is_ours)
