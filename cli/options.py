"""Reusable Typer option aliases, so every command spells (and checks) them the same.

Defaults come from the library's constants, never from literals here; each check raises a one-line
UsageError (exit 2) before any command touches a store or a directory.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any, Optional

import typer

from deltafs.defaults import MAX_LEVEL, MIN_LEVEL
from deltafs.errors import UsageError
from deltafs.format.versions import MAX_VERSION, check_version


def _version(value: Optional[int]) -> Optional[int]:
    return None if value is None else check_version(value, "--version")


def _zstd_level(flag: str) -> Callable[[int], int]:
    def check(value: int) -> int:
        if not MIN_LEVEL <= value <= MAX_LEVEL:
            raise UsageError(f"{flag} {value} is outside {MIN_LEVEL}..{MAX_LEVEL}")
        return value

    return check


def _threads(value: Optional[int]) -> Optional[int]:
    if value is not None and value < 1:
        raise UsageError(f"--threads must be at least 1, got {value}")
    return value


def finite_seconds(flag: str, *, positive: bool = False, unit: str = "seconds") -> Any:
    """A callback that accepts only finite, non-negative (or, with positive, > 0) values: seconds, or another unit."""

    def check(value: Optional[float]) -> Optional[float]:
        if value is None:
            return None
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise UsageError(f"{flag} must be a finite number{f' of {unit}' if unit else ''} "
                             f"{'> 0' if positive else '>= 0'}, got {value}")
        return value

    return check


StorageOptions = Annotated[
    Optional[str],
    typer.Option("--storage-options", help="fsspec storage options as a JSON object or @file.json (default: $DELTAFS_STORAGE_OPTIONS); keep secrets in a file or the environment, not in argv."),
]
# Only the long form: -V is the program's version, and -v (verbose elsewhere) is nothing here.
PushVersion = Annotated[Optional[int], typer.Option(
    "--version", callback=_version, help=f"Version number to publish, 0..{MAX_VERSION} (default: the store's newest + 1).")]
PullVersion = Annotated[Optional[int], typer.Option(
    "--version", callback=_version, help="Version number to pull (default: the newest).")]
Version = Annotated[Optional[int], typer.Option(
    "--version", callback=_version, help="Version number (default: HEAD's).")]
Level = Annotated[int, typer.Option(
    "--level", callback=_zstd_level("--level"),
    help=f"zstd level of the delta codecs' streams, {MIN_LEVEL}..{MAX_LEVEL}; 5 and above also split elements by magnitude (~18% smaller bf16 deltas, slower).")]
FullLevel = Annotated[int, typer.Option(
    "--full-level", callback=_zstd_level("--full-level"),
    help=f"zstd level of chunks stored whole (full versions, new tensors), {MIN_LEVEL}..{MAX_LEVEL}.")]
Threads = Annotated[Optional[int], typer.Option(
    "--threads", callback=_threads, help="Worker threads, at least 1 (default: CPU count, at most 8).")]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors.")]


def json_object(text: str | None, flag: str) -> dict[str, Any]:
    """The JSON object an option was given (inline or @file.json), or {}; a one-line UsageError otherwise."""
    from deltafs.store.options import parse_options_text

    return parse_options_text(text, flag) if text else {}


def parse_storage_options(text: str | None) -> dict[str, Any]:
    """--storage-options (JSON or @file.json), else $DELTAFS_STORAGE_OPTIONS, else {}."""
    from deltafs.store.options import resolve_storage_options

    return resolve_storage_options(text)
