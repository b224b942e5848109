"""One exception hierarchy; the CLI maps each class to an exit code and a one-line message."""

from __future__ import annotations

import re


class DeltafsError(Exception):
    """Base of every error deltafs raises on purpose."""

    exit_code = 1


class UsageError(DeltafsError, ValueError):
    """Bad arguments or bad input that the user can fix."""

    exit_code = 2


class SourceError(DeltafsError, ValueError):
    """A push source that is missing, unreadable or not a checkpoint."""

    exit_code = 2


class StoreError(DeltafsError, OSError):
    """The store cannot be reached or used (backend missing, credentials, bucket)."""

    exit_code = 3


class StoreNotFoundError(StoreError, FileNotFoundError):
    """No deltafs store at that URL."""


class ObjectNotFoundError(StoreError, FileNotFoundError):
    """A key that should be in the store is not."""


class ChunkNotFoundError(ObjectNotFoundError):
    """A chunk a manifest references is missing."""


class VersionNotFoundError(DeltafsError, LookupError):
    """The asked-for version is not in the store."""

    exit_code = 4


class FormatError(DeltafsError, ValueError):
    """A manifest, HEAD or store config that is malformed or of an unknown format version."""

    exit_code = 5


class IntegrityError(DeltafsError, ValueError):
    """Bytes whose digest or size differs from what the manifest promises."""

    exit_code = 6

    def __init__(self, what: str, expected: object = None, actual: object = None) -> None:
        self.what = what
        self.expected = expected
        self.actual = actual
        detail = f" (expected {expected}, got {actual})" if expected is not None else ""
        super().__init__(f"{what}{detail}")


class VersionConflictError(DeltafsError, RuntimeError):
    """Another writer claimed the version first, or HEAD moved under a push."""

    exit_code = 7


class LockHeldError(DeltafsError, RuntimeError):
    """Someone else holds the lock (another pull on this DEST, another gc on this store)."""

    exit_code = 8


class DestinationError(DeltafsError, RuntimeError):
    """DEST holds something deltafs will not overwrite (another store's checkpoint, foreign files)."""

    exit_code = 9


class EngineError(DeltafsError, RuntimeError):
    """An inference engine refused or failed a weight update."""

    exit_code = 10


_ERRNO = re.compile(r"\[Errno -?\d+\] ([^'\"\)\]]+)")
_URL = re.compile(r"host='([^']+)', port=(\d+)")


def short_problem(exc: BaseException, limit: int = 160) -> str:
    """One short line for a status table: what went wrong, without an HTTP library's nested reprs."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "Max retries exceeded" in text or "NewConnectionError" in text or "ConnectTimeout" in text:
        where = _URL.search(text)
        why = _ERRNO.search(text)
        reason = why.group(1).strip().lower() if why else ("timed out" if "Timeout" in text else "connection failed")
        cut = min((i for i in (text.find("HTTPConnectionPool("), text.find("HTTPSConnectionPool(")) if i >= 0),
                  default=-1)
        prefix = text[:cut].rstrip(" :(") if cut > 0 else ""
        if prefix:  # our own words first ("cannot reach SGLang at ..."), then the reason instead of urllib3's repr
            text = f"{prefix}: {reason}"
        else:
            text = f"cannot reach {where.group(1)}:{where.group(2)} ({reason})" if where else f"cannot connect ({reason})"
    elif not isinstance(exc, DeltafsError):
        text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 1] + "…"
