"""The valid range of version numbers: one definition, used on write (CLI, push) and on read (listing).

Manifest keys are `manifests/v<version:010d>.json`, so a version is 0 .. 9 999 999 999: exactly ten
digits in its key, and a lister matching ten digits can never miss a valid manifest. A millisecond
timestamp (13 digits) is not a version; use it as metadata (`--meta step=...`).
"""

from __future__ import annotations

from deltafs.errors import UsageError, integer

MIN_VERSION = 0
MAX_VERSION = 9_999_999_999
VERSION_DIGITS = 10


def check_version(version: int, what: str = "version") -> int:
    """version as an int if it is one in MIN_VERSION..MAX_VERSION (an integer of another type, numpy's say, is taken
    as its value); UsageError (exit 2) otherwise."""
    value = integer(version)  # numpy's integers too; no bool of any kind
    if value is None:
        raise UsageError(f"{what} must be an integer, got {version!r} ({type(version).__name__})")
    version = value
    if not MIN_VERSION <= version <= MAX_VERSION:
        raise UsageError(f"{what} {version!r} is outside {MIN_VERSION}..{MAX_VERSION} "
                         f"(at most {VERSION_DIGITS} digits; put timestamps in --meta)")
    return version
