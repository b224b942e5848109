"""Which verified version directories pull left beside DEST, and the version string engines report.

They live with the DEST layout in deltafs.read.dest; engines use them from here.
"""

from __future__ import annotations

from typing import Any

from deltafs.format.manifest import Manifest
from deltafs.read.dest import find_version_dir, labelled_version_dirs, read_version_state, weight_version


def reported_version(info: dict[str, Any]) -> str | None:
    """The weight_version an engine's answer reports, as text (3 and "3" are one version), or None."""
    version = info.get("weight_version")
    return None if version is None else str(version)


def read_version_manifest(version_dir: str) -> Manifest:
    """The manifest pull recorded beside a version directory (<dir>.json)."""
    return read_version_state(version_dir)[0]


__all__ = ["find_version_dir", "labelled_version_dirs", "read_version_manifest", "reported_version", "weight_version"]
