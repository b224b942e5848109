"""Reusable Typer option aliases, so every command spells them the same."""

from __future__ import annotations

import json
from typing import Annotated, Any, Optional

import typer

from deltafs.errors import UsageError

StorageOptions = Annotated[
    Optional[str],
    typer.Option("--storage-options", help="fsspec storage options as a JSON object or @file.json (default: $DELTAFS_STORAGE_OPTIONS); keep secrets in a file or the environment, not in argv."),
]
Version = Annotated[Optional[int], typer.Option("--version", "-v", help="Version number (default: the newest).")]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors.")]


def json_object(text: str | None, flag: str) -> dict[str, Any]:
    """The JSON object an option was given, or {}; a one-line UsageError otherwise."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{flag} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise UsageError(f"{flag} must be a JSON object")
    return value


def parse_storage_options(text: str | None) -> dict[str, Any]:
    """--storage-options (JSON or @file.json), else $DELTAFS_STORAGE_OPTIONS, else {}."""
    from deltafs.store.options import resolve_storage_options

    return resolve_storage_options(text)
