"""Reusable Typer option aliases, so every command spells them the same."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

StorageOptions = Annotated[
    Optional[str],
    typer.Option("--storage-options", help="JSON object of fsspec storage options, e.g. '{\"endpoint_url\": \"http://...\"}'."),
]
Version = Annotated[Optional[int], typer.Option("--version", "-v", help="Version number (default: the newest).")]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors.")]
