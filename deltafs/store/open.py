"""Turn a URL (plain path, file://, memory://, s3:// …) into an ObjectStore.

Storage options are fsspec's, passed to the backend unchanged, except one key of our own:
"deltafs", an object with the store's tuning and capability overrides (see DELTAFS_OPTIONS).
fsspec's own configuration (FSSPEC_S3_* variables, ~/.config/fsspec) and the backend's
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_PROFILE …) apply as usual.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

from deltafs.errors import StoreError, UsageError
from deltafs.store.base import ObjectStore, RetryPolicy
from deltafs.store.fsspec import FsspecObjectStore
from deltafs.store.local import LocalObjectStore
from deltafs.store.memory import MemoryObjectStore
from deltafs.store.options import check_option_names, check_option_values

log = logging.getLogger("deltafs.store")

# Which pip extra brings the fsspec backend for a protocol, for the error message.
_EXTRAS = {"s3": ("s3", "s3fs"), "s3a": ("s3", "s3fs"), "gs": ("gcs", "gcsfs"), "gcs": ("gcs", "gcsfs")}

# Keys accepted under storage_options["deltafs"].
DELTAFS_OPTIONS = {
    "attempts": "tries per call on transient errors (default 5)",
    "base_delay": "first backoff in seconds, doubled per retry (default 0.2)",
    "max_delay": "largest backoff in seconds (default 5)",
    "visibility_timeout": "seconds a referenced key may take to appear on an eventually consistent store (default 10)",
    "request_timeout": "seconds one read, write, stat or delete of an object store may take in all before it is "
                       "abandoned and retried (default 120; 0: no limit)",
    "max_workers": "parallel requests to the store (default: cores for a local path, 16-32 remote)",
    "read_after_write": "false for a store whose new objects may be invisible for a while",
    "atomic_create": "false for an S3-compatible server that ignores If-None-Match",
}


def _split_tuning(options: dict[str, Any]) -> tuple[RetryPolicy, dict[str, Any], dict[str, bool]]:
    tuning = options.pop("deltafs", None) or {}
    if not isinstance(tuning, dict):
        raise UsageError('storage option "deltafs" must be a JSON object')
    unknown = sorted(set(tuning) - set(DELTAFS_OPTIONS))
    if unknown:
        raise UsageError(f'unknown key(s) in storage option "deltafs": {", ".join(unknown)} '
                         f'(known: {", ".join(DELTAFS_OPTIONS)})')
    retry = RetryPolicy(**{k: _tuning_number(k, tuning[k]) for k in _TUNING_BOUNDS if k in tuning
                           and k != "max_workers"})
    workers = {"max_workers": int(_tuning_number("max_workers", tuning["max_workers"]))} if "max_workers" in tuning else {}
    flags = {}
    for k in ("read_after_write", "atomic_create"):
        if k in tuning:
            # Exactly true or false: "false" read as a truth value would keep a safety the user turned off, or
            # the other way round (a server that ignores If-None-Match still trusted for atomic creates).
            if type(tuning[k]) is not bool:
                raise UsageError(f'storage option "deltafs": {k} must be true or false (JSON), not {tuning[k]!r}')
            flags[k] = tuning[k]
    return retry, workers, flags


# Numeric tuning keys: (integer only, least, most). request_timeout 0 means no limit.
_TUNING_BOUNDS: dict[str, tuple[bool, float, float]] = {
    "attempts": (True, 1, 1000), "base_delay": (False, 0, 3600), "max_delay": (False, 0, 86400),
    "visibility_timeout": (False, 0, 86400), "request_timeout": (False, 0, 86400), "max_workers": (True, 1, 1024),
}


def _tuning_number(key: str, value: Any) -> Any:
    whole, low, high = _TUNING_BOUNDS[key]
    ok = type(value) is int or (type(value) is float and not whole and math.isfinite(value))
    if not ok or not low <= value <= high:
        kind = "an integer" if whole else "a number"
        raise UsageError(f'storage option "deltafs": {key} must be {kind} from {low:g} to {high:g}, not {value!r}')
    return value if whole else float(value)


def _s3_defaults(options: dict[str, Any]) -> dict[str, Any]:
    """Defaults that make s3fs fail fast and leave retrying to deltafs (one policy, visible in errors).

    Anything the user set, in storage options or fsspec's config, wins.
    """
    import fsspec  # only for remote stores: a local path never loads it (~45 ms of every CLI start)

    configured = {**fsspec.config.conf.get("s3", {}), **options}
    out = dict(options)
    # Listings are our source of truth for versions: never answer them from a cache.
    out.setdefault("use_listings_cache", configured.get("use_listings_cache", False))
    config = dict(configured.get("config_kwargs") or {})
    config.setdefault("connect_timeout", 10)
    config.setdefault("read_timeout", 60)
    # One retry policy, deltafs's (backoff with jitter, bounded, reported in errors), instead of
    # botocore's multiplied by s3fs's multiplied by ours.
    config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
    out["config_kwargs"] = config
    return out


_KNOWN_SCHEMES = ("s3", "s3a", "gs", "gcs", "memory")  # remote ones: "file:/x" is left as it was


def local_path(url: str) -> str | None:
    """The directory a store URL names on this host (a plain path, file://, local://), or None for other stores."""
    protocol, _, rest = url.partition("://") if "://" in url else ("file", "", url)
    return os.path.abspath(os.path.expanduser(rest)) if protocol in ("file", "local") else None


def open_objects(url: str, storage_options: dict[str, Any] | None = None) -> ObjectStore:
    """An ObjectStore for url; local paths get atomic rename-based writes."""
    options = dict(storage_options or {})
    scheme = url.split(":/", 1)[0] if ":/" in url and "://" not in url else None
    if scheme in _KNOWN_SCHEMES:
        # "s3:/bucket/run" would be a local directory named "s3:" in the working directory, silently.
        raise UsageError(f"{url} is not a valid {scheme}:// URL (one slash after the colon) and would be a local path; "
                         f"write {scheme}://{url.split(':/', 1)[1].lstrip('/')}")
    protocol, _, rest = url.partition("://") if "://" in url else ("file", "", url)
    if protocol in ("s3", "s3a") and not rest.strip("/"):
        raise UsageError(f"{url} names no bucket: write {protocol}://BUCKET/PREFIX")
    if protocol not in ("file", "local") and "//" in rest.strip("/"):
        # An object store keeps the empty component ("bucket//run" stores "/run/HEAD"), and listings then miss the
        # store's own keys: log shows nothing, gc and verify stop. A local path means the same with one slash.
        raise UsageError(f"{url} has an empty path component (//); write it with single slashes")
    check_option_names(protocol, options)
    check_option_values(protocol, options)
    retry, workers, flags = _split_tuning(options)
    store: ObjectStore
    root = local_path(url)
    if root is not None:
        store = LocalObjectStore(root, url, retry=retry, **workers)
    elif protocol in ("gs", "gcs"):
        from deltafs.store.gcs import open_gcs

        store = open_gcs(url, options, retry=retry, workers=workers)
    else:
        if protocol in ("s3", "s3a"):
            options = _s3_defaults(options)
        fs, root = _filesystem(url, protocol, options)
        if protocol == "memory":
            store = MemoryObjectStore(fs, "/" + root.lstrip("/"), url, retry=retry, **workers)
        elif protocol in ("s3", "s3a"):
            from deltafs.store.s3 import S3ObjectStore

            # s3fs retries each request itself too (class default 5); deltafs owns retrying.
            fs.retries = 1
            store = S3ObjectStore(fs, root, url, retry=retry, **workers)
        else:
            log.warning(f"{protocol}:// has no create-if-absent write: two pushers racing for one version could both "
                        "commit it; run one pusher per store (see manifests/FORMAT.md, backends)")
            store = FsspecObjectStore(fs, root, url, retry=retry, **workers)
    if flags:
        store.declare(**flags)
    return store


def _filesystem(url: str, protocol: str, options: dict[str, Any]) -> tuple[Any, str]:
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
        return fs, str(root)
    except ImportError as exc:
        extra = _EXTRAS.get(protocol)
        hint = (f"run: pip install {extra[1]} (deltafs's [{extra[0]}] extra)" if extra
                else f"install the fsspec package that implements {protocol}://")
        raise StoreError(f"no backend installed for {protocol}:// ({exc}); {hint}") from None
    except ValueError as exc:
        if "Protocol not known" in str(exc):
            raise StoreError(f"unknown storage protocol {protocol}:// in {url}") from None
        raise StoreError(f"cannot open {url}: {exc}") from None
    except TypeError as exc:
        raise UsageError(f"bad storage options for {protocol}://: {exc}") from None
