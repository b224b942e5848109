"""Google Cloud Storage through gcsfs: conditional create with the generation precondition.

GCS evaluates `ifGenerationMatch=0` atomically: the upload succeeds only if no live object has
the name, otherwise HTTP 412; gcsfs sends it for pipe_file(..., mode="create") and maps the 412 to
FileExistsError. deltafs sends every create as one single-request (multipart) upload, whatever
its size, so the precondition rides on the request that stores the object. (fake-gcs-server, the
emulator the tests run, honours the precondition on single-request uploads but ignores it on
resumable ones; GCS honours both.) GCS is strongly consistent for reads, overwrites and listings.

gcsfs's plain GCSFileSystem is used, not the experimental ExtendedGcsFileSystem that gcsfs
exports by default: that one asks the gRPC control plane for every bucket's layout (60 s of
retries against anything but production GCS) to support zonal (Rapid) buckets, which deltafs
does not target. gcsfs's own retry loop (6 tries with up to 32 s pauses, fixed in its code) is
taken off, so deltafs's policy is the only one: bounded, with jitter, and reported in errors.
"""

from __future__ import annotations

import json
import re
from typing import Any

from deltafs.errors import ObjectNotFoundError, StoreError, StoreNotFoundError, UsageError
from deltafs.store.base import Capabilities, RetryPolicy, _Kind, classify
from deltafs.store.fsspec import FsspecObjectStore

_TRANSIENT_CODES = {408, 429, 500, 502, 503, 504}
# The URL of an object listing: b/BUCKET/o with nothing after it.
_LISTING = re.compile(r"(^|/)b/[^/]+/o/?$")


def _status(exc: BaseException) -> int | None:
    """The HTTP status behind a gcsfs HttpError, if any."""
    code = getattr(exc, "code", None)
    try:
        return int(code) if code is not None else None
    except (TypeError, ValueError):
        return None


class GCSObjectStore(FsspecObjectStore):
    """gs:// buckets (Google Cloud Storage, fake-gcs-server)."""

    capabilities = Capabilities(atomic_put=True, atomic_create=True, read_after_write=True)
    default_workers = 32

    def __init__(self, fs: Any, root: str, url: str, *, retry: RetryPolicy | None = None,
                 max_workers: int | None = None) -> None:
        super().__init__(fs, root, url, retry=retry, max_workers=max_workers)
        self.bucket = self.root.split("/", 1)[0]
        self._bucket_seen = False

    def _denied_hint(self) -> str:
        return "check the credentials (token storage option, GOOGLE_APPLICATION_CREDENTIALS) and the bucket's IAM"

    def _kind(self, exc: BaseException) -> _Kind | None:
        text = str(exc)
        if isinstance(exc, FileNotFoundError):
            # gcsfs raises FileNotFoundError(url) for any 404. An upload or a listing names no
            # object that could be missing, so there the 404 is the bucket's.
            if "/upload/storage/v1/b/" in text or _LISTING.search(text):
                return _Kind.NO_BUCKET
            return _Kind.NOT_FOUND
        status = _status(exc)
        if status == 401 and "Invalid Credentials" in text:
            return _Kind.TRANSIENT  # an access token that expired in flight; gcsfs refreshes it
        if status in (401, 403) or (isinstance(exc, OSError) and text.startswith("Forbidden")):
            return _Kind.DENIED
        if status in _TRANSIENT_CODES or type(exc).__name__ == "ProxyError":
            return _Kind.TRANSIENT
        if isinstance(exc, json.JSONDecodeError):
            # gcsfs parsing an answer that arrived damaged or cut (a listing page, an object's metadata): the
            # network's fault, retried like one. Only the backend's own calls run under _call.
            return _Kind.TRANSIENT
        return classify(exc)  # gcsfs's ChecksumError (a download that fails its crc32c/md5): damaged, retried

    # --- a missing bucket looks like a missing key on reads: ask once, on a miss ----------------
    async def _abucket_exists(self) -> bool:
        if self._bucket_seen:
            return True
        try:
            await self.fs._call("GET", "b/{}", self.bucket, json_out=True)
        except FileNotFoundError:
            return False
        except Exception:
            return True
        self._bucket_seen = True
        return True

    def _no_bucket(self) -> StoreNotFoundError:
        return StoreNotFoundError(f"bucket of {self.url} does not exist: create it or fix the URL")

    def _check_bucket(self) -> None:
        from fsspec.asyn import sync

        if not sync(self.fs.loop, self._abucket_exists, **self.deadline()):
            raise self._no_bucket()

    def get(self, key: str, *, referenced: bool = False, limit: int | None = None) -> bytes:
        try:
            return super().get(key, referenced=referenced, limit=limit)
        except ObjectNotFoundError:
            self._check_bucket()
            raise

    # --- metadata: one GET of the object resource ----------------------------------------------
    def _meta(self, key: str) -> dict[str, Any]:
        from fsspec.asyn import sync

        return dict(sync(self.fs.loop, self.fs._get_object, self.path(key), **self.deadline()))

    def _isfile(self, key: str) -> bool:
        # gcsfs's isfile lists the prefix after a 404; one GET answers the question.
        try:
            self._meta(key)
            return True
        except FileNotFoundError:
            return False

    def _stat(self, key: str) -> tuple[int, float | None]:
        meta = self._meta(key)
        modified = meta.get("mtime")
        return int(meta["size"]), modified.timestamp() if modified is not None else None

    def stat(self, key: str) -> tuple[int, float | None]:
        try:
            return super().stat(key)
        except ObjectNotFoundError:
            self._check_bucket()
            raise

    # --- create-if-absent ------------------------------------------------------------------------
    async def _acreate(self, key: str, data: bytes, equal_is_ours: bool) -> bool:
        """One single-request upload with ifGenerationMatch=0; False when another object is there.

        A 412 to a create deltafs retried (after a dropped connection whose request had in fact
        been stored) counts as ours when the stored bytes equal data: manifests carry their
        creation time, so two writers never produce the same manifest bytes, and equal
        content-addressed chunks are the same chunk anyway.
        """
        path = self.path(key)
        try:
            # chunksize above the size: never a resumable upload (see the module docstring).
            await self.fs._pipe_file(path, data, mode="create", chunksize=len(data) + 1)
            return True
        except FileExistsError:
            return equal_is_ours and bytes(await self.fs._cat_file(path)) == data

    def _create(self, key: str, data: bytes, equal_is_ours: bool = True) -> bool:
        if not self.capabilities.atomic_create:
            return super()._create(key, data, equal_is_ours)
        from fsspec.asyn import sync

        return bool(sync(self.fs.loop, self._acreate, key, data, equal_is_ours, **self.deadline()))


def _filesystem_class() -> Any:
    from gcsfs.core import GCSFileSystem

    class DeltafsGCSFileSystem(GCSFileSystem):  # type: ignore[misc]
        """gcsfs with one try per request: retrying is deltafs's (see the module docstring)."""

        # _request is wrapped by gcsfs.retry.retry_request (the decorator package keeps the
        # undecorated coroutine function as __wrapped__). A subclass has its own fsspec instance
        # cache, so other users of gcsfs in the process keep gcsfs's retries.
        _request = getattr(GCSFileSystem._request, "__wrapped__", GCSFileSystem._request)

    return DeltafsGCSFileSystem


_FS_CLASS: Any = None


def open_gcs(url: str, options: dict[str, Any], *, retry: RetryPolicy, workers: dict[str, int]) -> GCSObjectStore:
    """A GCSObjectStore for gs://bucket/prefix; options are gcsfs.GCSFileSystem's."""
    global _FS_CLASS
    try:
        if _FS_CLASS is None:
            _FS_CLASS = _filesystem_class()
    except ImportError as exc:
        raise StoreError(f"no backend installed for gs:// ({exc}); run: pip install gcsfs (deltafs's [gcs] extra)") from None
    GCSFileSystem = _FS_CLASS
    options = dict(options)
    # Listings are our source of truth for versions: never answer them from a cache.
    options.setdefault("use_listings_cache", False)
    # gcsfs sets no timeout on its HTTP requests: one a server stops answering would wait forever (a listing page
    # too, which RetryPolicy.request_timeout does not cover). 60 s per request, as s3fs's read_timeout here.
    options.setdefault("requests_timeout", 60)
    try:
        fs = GCSFileSystem(**options)
    except TypeError as exc:
        raise UsageError(f"bad storage options for gs://: {exc}") from None
    root = GCSFileSystem._strip_protocol(url).rstrip("/")
    if not root:
        raise UsageError(f"{url} names no bucket: use gs://BUCKET/PREFIX")
    return GCSObjectStore(fs, root, url, retry=retry, **workers)
