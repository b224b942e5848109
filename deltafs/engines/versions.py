"""Which verified version directories pull left beside DEST, and the version string engines report."""

from __future__ import annotations

import json

from deltafs.errors import FormatError
from deltafs.format.manifest import Manifest, canonical_json
from deltafs.read.dest import LocalCheckpoint


def weight_version(version: int) -> str:
    """The weight_version string an engine reports for a deltafs version (its number)."""
    return str(int(version))


def read_version_manifest(version_dir: str) -> Manifest:
    """The manifest pull recorded beside a version directory (<dir>.json)."""
    path = version_dir.rstrip("/") + ".json"
    try:
        with open(path, "rb") as fh:
            raw = json.loads(fh.read())
        return Manifest.from_bytes(canonical_json(raw["manifest"]), where=path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise FormatError(f"no usable deltafs state for {version_dir} ({exc}); pull it first") from None


def find_version_dir(dest: str, version: str) -> str | None:
    """The verified version directory beside DEST whose weight version is `version`, if pull kept it."""
    for path in reversed(LocalCheckpoint(dest).version_dirs()):
        try:
            if weight_version(read_version_manifest(path).version) == version:
                return path
        except FormatError:
            continue
    return None
