"""One exception hierarchy; the CLI maps each class to an exit code and a one-line message."""

from __future__ import annotations


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
