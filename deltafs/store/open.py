"""Turn a URL (plain path, file://, memory://, s3:// …) into an ObjectStore."""

from __future__ import annotations

import json
import os
from typing import Any

import fsspec

from deltafs.errors import StoreError, UsageError
from deltafs.store.objects import LocalObjectStore, MemoryObjectStore, ObjectStore

# Which pip extra brings the fsspec backend for a protocol, for the error message.
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


def parse_storage_options(text: str | None) -> dict[str, Any]:
    """The --storage-options JSON object, or {}."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--storage-options is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise UsageError("--storage-options must be a JSON object")
    return value


def open_objects(url: str, storage_options: dict[str, Any] | None = None) -> ObjectStore:
    """An ObjectStore for url; local paths get atomic rename-based writes."""
    options = dict(storage_options or {})
    protocol, _, rest = url.partition("://") if "://" in url else ("file", "", url)
    if protocol in ("file", "local"):
        root = os.path.abspath(os.path.expanduser(rest))
        return LocalObjectStore(fsspec.filesystem("file"), root, url)
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        extra = _EXTRAS.get(protocol)
        hint = f" Install it with: pip install 'deltafs[{extra}]'" if extra else ""
        raise StoreError(f"no backend installed for {protocol}:// ({exc}).{hint}") from None
    except ValueError as exc:
        raise StoreError(f"cannot open {url}: {exc}") from None
    if protocol == "memory":
        return MemoryObjectStore(fs, "/" + root.lstrip("/"), url)
    if protocol in ("s3", "s3a"):
        from deltafs.store.s3 import S3ObjectStore

        return S3ObjectStore(fs, root, url)
    return ObjectStore(fs, root, url)
