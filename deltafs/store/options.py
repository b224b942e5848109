"""Storage options: where they come from (argument, @file, environment) and which names a backend takes.

fsspec backends accept **kwargs and ignore what they do not know, so a misspelled `endpoint_url`
would silently talk to the default endpoint. For the backends deltafs knows, names are checked
against the backend class's own constructor signatures.
"""

from __future__ import annotations

import difflib
import inspect
import json
import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from deltafs.errors import UsageError

ENV_VAR = "DELTAFS_STORAGE_OPTIONS"
MAX_OPTIONS_FILE = 1 << 20

# Accepted by every fsspec filesystem (fsspec.spec.AbstractFileSystem and its instance cache).
_FSSPEC_COMMON = {"use_listings_cache", "listings_expiry_time", "max_paths", "skip_instance_cache", "asynchronous", "loop"}
_CHECKED = {"file": "file", "local": "file", "memory": "memory", "s3": "s3", "s3a": "s3", "gs": "gs", "gcs": "gs"}


def parse_options_text(text: str, what: str) -> dict[str, Any]:
    """A JSON object given inline or as @path (a file holding the JSON object)."""
    source = what
    if text.startswith("@"):
        path = os.path.expanduser(text[1:])
        try:
            if not os.path.isfile(path):
                raise UsageError(f"{what}: {path} is not a regular file")
            with open(path, "rb") as fh:
                raw = fh.read(MAX_OPTIONS_FILE + 1)
        except OSError as exc:
            raise UsageError(f"{what}: cannot read {path}: {exc.strerror or exc}") from None
        if len(raw) > MAX_OPTIONS_FILE:
            raise UsageError(f"{what}: {path} is larger than {MAX_OPTIONS_FILE} bytes")
        text, source = raw.decode("utf-8", "replace"), f"{what} file {path}"
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise UsageError(f"{source} is not valid JSON: {str(exc)[:120]}") from None
    if not isinstance(value, dict):
        raise UsageError(f"{source} must be a JSON object")
    return value


def resolve_storage_options(text: str | None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """--storage-options if given (JSON or @file), else $DELTAFS_STORAGE_OPTIONS (JSON or @file), else {}.

    Keeps credentials out of argv: put them in a file or the environment.
    """
    if text:
        return parse_options_text(text, "--storage-options")
    env_text = (env if env is not None else os.environ).get(ENV_VAR, "").strip()
    return parse_options_text(env_text, f"${ENV_VAR}") if env_text else {}


def _accepted_names(cls: type) -> set[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters
        names.update(n for n, p in params.items()
                     if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n not in ("self", "storage_options"))
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            break  # this constructor passes nothing further up
    return names | _FSSPEC_COMMON


def check_option_names(protocol: str, options: Mapping[str, Any]) -> None:
    """Refuse option names the backend would silently ignore (only for backends deltafs knows)."""
    backend = _CHECKED.get(protocol)
    if backend is None or not options:
        return
    import fsspec

    try:
        cls = fsspec.get_filesystem_class(backend)
    except (ImportError, ValueError):
        return  # the missing backend is reported when the store is opened
    accepted = _accepted_names(cls) | {"deltafs"}
    unknown = sorted(set(options) - accepted)
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, sorted(accepted), n=1)
            hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise UsageError(f"unknown storage option(s) for {protocol}://: {', '.join(hints)}")


# Option values of the backends' common settings, checked before the backend sees them: a wrong kind there is an
# AttributeError or ValueError deep in botocore or gcsfs at the first request (an internal error, exit 1).
_DICT_OPTIONS = ("client_kwargs", "config_kwargs", "s3_additional_kwargs", "requester_pays_kwargs")
_TEXT_OPTIONS = ("key", "secret", "token", "profile", "project", "region_name")


def check_option_values(protocol: str, options: Mapping[str, Any]) -> None:
    """UsageError for values of the wrong kind: an endpoint_url that is no http(s) URL, a *_kwargs that is not an
    object (config_kwargs.retries too), a credential that is not text, an anon that is not true or false."""
    if protocol not in ("s3", "s3a", "gs", "gcs"):
        return  # the local and memory stores take none of these (check_option_names refuses them)
    where = f"storage option for {protocol}://"
    for name in _DICT_OPTIONS:
        if options.get(name) is not None and not isinstance(options[name], dict):
            raise UsageError(f"{where} {name} must be a JSON object, not {options[name]!r}")
    for name, endpoint in (("endpoint_url", options.get("endpoint_url")),
                           ("client_kwargs.endpoint_url", (options.get("client_kwargs") or {}).get("endpoint_url"))):
        if endpoint is not None:
            parsed = urlsplit(endpoint) if isinstance(endpoint, str) else None
            if parsed is None or parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise UsageError(f"{where} {name} must be an http:// or https:// URL, not {endpoint!r}")
    retries = (options.get("config_kwargs") or {}).get("retries")
    if retries is not None and not isinstance(retries, dict):
        raise UsageError(f"{where} config_kwargs.retries must be a JSON object (e.g. {{\"max_attempts\": 3}}), "
                         f"not {retries!r}")
    for name in _TEXT_OPTIONS:
        if protocol in ("gs", "gcs") and (name == "token" or (name == "project" and type(options.get(name)) is int)):
            continue  # gcsfs takes a token file, "anon", "cloud" or the credentials as an object; a numeric project
        if options.get(name) is not None and not isinstance(options[name], str):
            raise UsageError(f"{where} {name} must be text, not {options[name]!r}")
    if "anon" in options and type(options["anon"]) is not bool:
        raise UsageError(f"{where} anon must be true or false, not {options['anon']!r}")
