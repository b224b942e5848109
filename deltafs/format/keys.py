"""Every key of the store layout, and the valid range of version numbers. No I/O.

    deltafs.json                 the store config, written once
    HEAD                         the newest committed version (the one mutable pointer)
    manifests/v{N:010d}.json     version N's manifest (the commit point)
    folds/v{N:010d}.json         optional folded delta of version N against its full version
    bridges/v{N:010d}.json       optional delta of full version N against its parent (a keyframe's bridge)
    chunks/{id[:2]}/{id}         chunk objects, named by the sha256 of their bytes
    locks/{name}.json            advisory locks (gc)
    fleet/{host_id}.json         one status record per watching host
"""

from __future__ import annotations

import re

from deltafs.errors import FormatError, UsageError
from deltafs.format.versions import MAX_VERSION, MIN_VERSION

CONFIG_KEY = "deltafs.json"
HEAD_KEY = "HEAD"
MANIFEST_PREFIX = "manifests"
FOLD_PREFIX = "folds"
BRIDGE_PREFIX = "bridges"
CHUNK_PREFIX = "chunks"
LOCK_PREFIX = "locks"
FLEET_PREFIX = "fleet"
GC_LOCK_KEY = f"{LOCK_PREFIX}/gc.json"

# Version numbers are MIN_VERSION..MAX_VERSION (deltafs.format.versions): exactly ten digits in a key.
_VERSION_NAME = re.compile(r"^v(\d+)\.json$")
_OBJECT_ID = re.compile(r"^[0-9a-f]{64}$")
_HOST_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def is_valid_version(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and MIN_VERSION <= value <= MAX_VERSION


def _version_name(version: int) -> str:
    if not is_valid_version(version):
        raise FormatError(f"version {version!r} is outside {MIN_VERSION}..{MAX_VERSION}")
    return f"v{version:010d}.json"


def _parse_version_name(key: str, prefix: str) -> int | None:
    folder, _, name = key.rpartition("/")
    if folder != prefix and not folder.endswith("/" + prefix):
        return None
    m = _VERSION_NAME.match(name)
    if m is None:
        return None
    version = int(m.group(1))
    # Only the one spelling a writer produces: v0000000001.json, never v00000000001.json.
    return version if is_valid_version(version) and name == _version_name(version) else None


def manifest_key(version: int) -> str:
    return f"{MANIFEST_PREFIX}/{_version_name(version)}"


def parse_manifest_key(key: str) -> int | None:
    """The version a manifest key names, or None for anything a writer would not have written."""
    return _parse_version_name(key, MANIFEST_PREFIX)


def fold_key(version: int) -> str:
    return f"{FOLD_PREFIX}/{_version_name(version)}"


def parse_fold_key(key: str) -> int | None:
    return _parse_version_name(key, FOLD_PREFIX)


def bridge_key(version: int) -> str:
    return f"{BRIDGE_PREFIX}/{_version_name(version)}"


def parse_bridge_key(key: str) -> int | None:
    return _parse_version_name(key, BRIDGE_PREFIX)


def chunk_key(object_id: str) -> str:
    if not _OBJECT_ID.match(object_id):
        raise FormatError(f"bad chunk object id {object_id!r}")
    return f"{CHUNK_PREFIX}/{object_id[:2]}/{object_id}"


def parse_chunk_key(key: str) -> str | None:
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != CHUNK_PREFIX or not _OBJECT_ID.match(parts[2]) or parts[1] != parts[2][:2]:
        return None
    return parts[2]


def lock_key(name: str) -> str:
    return f"{LOCK_PREFIX}/{name}.json"


def check_host_id(host_id: str) -> str:
    if not isinstance(host_id, str) or not _HOST_ID.match(host_id):
        raise UsageError(f"host id {host_id!r} must be 1-128 letters, digits, '.', '_' or '-' and start with a letter or digit")
    return host_id


def fleet_key(host_id: str) -> str:
    return f"{FLEET_PREFIX}/{check_host_id(host_id)}.json"
