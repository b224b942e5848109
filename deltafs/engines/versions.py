"""Which verified version directories pull left beside DEST, and the version string engines report.

They live with the DEST layout in deltafs.read.dest; engines use them from here.
"""

from __future__ import annotations

from deltafs.format.manifest import Manifest
from deltafs.read.dest import find_version_dir, read_version_state, weight_version


def read_version_manifest(version_dir: str) -> Manifest:
    """The manifest pull recorded beside a version directory (<dir>.json)."""
    return read_version_state(version_dir)[0]


__all__ = ["find_version_dir", "read_version_manifest", "weight_version"]
