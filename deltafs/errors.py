"""One exception hierarchy and ONE exit-code table: the CLI maps every failure to a code through it.

The README's "Exit codes" table is this table; keep them the same.
"""

from __future__ import annotations

import errno
import operator
import re


class DeltafsError(Exception):
    """Base of every error deltafs raises on purpose."""


class UsageError(DeltafsError, ValueError):
    """Bad arguments or bad input that the user can fix."""


class SourceError(DeltafsError, ValueError):
    """A push source that is missing, unreadable or not a checkpoint."""


class StoreError(DeltafsError, OSError):
    """The store cannot be reached or used (backend missing, credentials, bucket)."""


class StoreNotFoundError(StoreError, FileNotFoundError):
    """No deltafs store at that URL."""


class ObjectNotFoundError(StoreError, FileNotFoundError):
    """A key that should be in the store is not."""


class ChunkNotFoundError(ObjectNotFoundError):
    """A chunk a manifest references is missing (an integrity failure of that version, exit 6)."""


class VersionNotFoundError(DeltafsError, LookupError):
    """The asked-for version is not in the store."""


class FormatError(DeltafsError, ValueError):
    """A manifest, HEAD or store config that is malformed or of an unknown format version."""


class IntegrityError(DeltafsError, ValueError):
    """Bytes whose digest or size differs from what the manifest promises."""

    def __init__(self, what: str, expected: object = None, actual: object = None) -> None:
        self.what = what
        self.expected = expected
        self.actual = actual
        detail = f" (expected {expected}, got {actual})" if expected is not None else ""
        super().__init__(f"{what}{detail}")


class VersionConflictError(DeltafsError, RuntimeError):
    """Another writer claimed the version first, or HEAD moved under a push."""


class LockHeldError(DeltafsError, RuntimeError):
    """Someone else holds the lock (another pull on this DEST, another gc on this store)."""


class DestinationError(DeltafsError, RuntimeError):
    """DEST holds something deltafs will not overwrite (another store's checkpoint, foreign files),
    or a path deltafs writes beside it is not deltafs's own (a planted symlink)."""


class ForeignStoreError(DestinationError):
    """DEST holds a verified checkpoint that deltafs pulled from another store (a watcher replaces it; pull needs
    --force)."""


class EngineError(DeltafsError, RuntimeError):
    """An inference engine refused or failed a weight update."""


class NotReadyError(DeltafsError):
    """Not every host of a multi-node engine has the version staged yet (`watch --once`)."""


class LocalWriteError(DeltafsError, OSError):
    """A local file could not be written: disk full, a file where a directory must go, a name too long."""


# --- the exit-code table ------------------------------------------------------------------------------
EXIT_OK = 0
EXIT_INTERNAL = 1  # an unexpected error (a bug: set DELTAFS_DEBUG=1 for the traceback); `status`: a host has a problem
EXIT_CURRENT = 100  # `pull --once`: DEST already holds the version (nothing done)
EXIT_BUSY = 101  # `pull --once`: another pull holds DEST's lock (skipped)
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, as shells report it)
EXIT_OUTPUT_CLOSED = 141  # stdout closed before the result was written (128 + SIGPIPE, as shells report it)

# Most specific first is not needed: exit_code() walks the exception's MRO, so a subclass listed
# here wins over its base (ChunkNotFoundError is a StoreError in Python but a 6 to the user).
EXIT_CODES: dict[type[BaseException], int] = {
    UsageError: 2,
    SourceError: 2,
    StoreError: 3,
    VersionNotFoundError: 4,
    FormatError: 5,
    IntegrityError: 6,
    ChunkNotFoundError: 6,
    VersionConflictError: 7,
    LockHeldError: 8,
    DestinationError: 9,
    EngineError: 10,
    NotReadyError: 11,
    LocalWriteError: 12,
}

# What each code means, for --help and the README (the same words).
EXIT_MEANINGS: dict[int, str] = {
    EXIT_OK: "success",
    EXIT_INTERNAL: "internal error (DELTAFS_DEBUG=1 shows the traceback); `status`: a host is unhealthy or silent",
    2: "bad arguments or source (including a --version outside 0..9999999999)",
    3: "store unreachable, bucket missing, credentials refused or backend not installed",
    4: "version not found (including a HEAD that names a missing version)",
    5: "malformed or unknown-format manifest, HEAD or store config (including file paths that cannot coexist)",
    6: "integrity failure: digest mismatch, corrupt, truncated or missing chunk; `verify` found a problem",
    7: "version conflict (another writer committed first)",
    8: "lock held (another gc on the store, another push using the same push cache, another process switching "
       "DEST's engine); a plain `pull` waits for another pull on DEST instead, and says so",
    9: "DEST refused: another store's checkpoint, foreign files, or a path beside DEST that deltafs did not make",
    10: "the engine refused or failed an update, or the version needs an engine restart",
    11: "not every host of a multi-node engine has the version staged yet (`watch --once`)",
    12: "local write failed: disk full, a file where a directory must go, a name too long, a file size limit, no "
        "permission (the message names the path)",
    EXIT_CURRENT: "`pull --once`: already current",
    EXIT_BUSY: "`pull --once`: another pull holds DEST's lock, or another process is switching DEST's engine",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C; SIGTERM to a one-shot command outside an engine switch)",
    EXIT_OUTPUT_CLOSED: "stdout was closed before the result was written (a reader such as `head` stopped first); "
                        "what the command did is done",
}

# Local OS errors that are the user's disk, not a bug: also a file size limit (ulimit -f, a filesystem's largest
# file) and permissions (a directory of DEST's made read-only), which were exit 1, "internal error".
_LOCAL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.ENAMETOOLONG, errno.ENOTDIR, errno.EISDIR, errno.EROFS, errno.EFBIG,
                 errno.EACCES, errno.EPERM}


def integer(value: object) -> int | None:
    """value as an int when it is an integer of any kind (Python's, numpy's, a torch scalar's: operator.index), never
    a bool of any kind; None otherwise. What version numbers and ranks accept."""
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", "")):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def check_count(value: object, what: str, least: int) -> int:
    """value itself if it is an int (not a bool) of at least `least`; UsageError (exit 2) otherwise. The one check of
    the API's counts (threads, keep), so push and pull refuse the same values with the same words."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise UsageError(f"{what} must be an integer of at least {least}, got {value!r}")
    return value


def exit_code(exc: BaseException) -> int:
    """The exit code of an exception, from the one table."""
    for cls in type(exc).__mro__:
        code = EXIT_CODES.get(cls)
        if code is not None:
            return code
    if isinstance(exc, OSError) and exc.errno in _LOCAL_ERRNOS:
        return EXIT_CODES[LocalWriteError]
    return EXIT_INTERNAL


def is_local_write_failure(exc: BaseException) -> bool:
    """An OSError that is the local disk's state (full, read-only, clashing or over-long names), not a bug."""
    return isinstance(exc, OSError) and not isinstance(exc, DeltafsError) and exc.errno in _LOCAL_ERRNOS


def local_write_error(exc: OSError, path: str | None = None, hint: str = "", elsewhere: str = "") -> LocalWriteError:
    """A one-line LocalWriteError naming the path, for an OSError raised while writing local files. hint: said about
    the other failures (free space); elsewhere: where else the files may go, said about every failure."""
    where = path or exc.filename or "a local file"
    more = f"; {elsewhere}" if elsewhere else ""
    if exc.errno in (errno.EACCES, errno.EPERM):  # a read may be the one denied, and free space is no cure
        err = LocalWriteError(f"cannot use {where}: {exc.strerror or exc} (check its owner and permissions{more})")
    elif exc.errno == errno.EFBIG:  # nor for a size limit
        err = LocalWriteError(f"cannot write {where}: {exc.strerror or exc} (a file size limit: `ulimit -f`, or the "
                              f"filesystem's largest file{more})")
    else:
        err = LocalWriteError(f"cannot write {where}: {exc.strerror or exc}{hint}")
    err.errno = exc.errno
    return err


_ERRNO = re.compile(r"\[Errno -?\d+\] ([^'\"\)\]]+)")
_URL = re.compile(r"host='([^']+)', port=(\d+)")


def connection_reason(exc: BaseException) -> str:
    """Why a connection failed, in a few words ("connection refused", "name or service not known", "timed out"),
    from the errno text urllib3 buries in its nested message."""
    text = str(exc)
    why = _ERRNO.search(text)
    return why.group(1).strip().lower() if why else ("timed out" if "Timeout" in text else "connection failed")


def short_problem(exc: BaseException, limit: int = 160) -> str:
    """One short line for a status table: what went wrong, without an HTTP library's nested reprs.

    Messages of other libraries' exceptions are cut at limit characters; deltafs's own are kept whole.
    """
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "Max retries exceeded" in text or "NewConnectionError" in text or "ConnectTimeout" in text:
        where = _URL.search(text)
        reason = connection_reason(exc)
        cut = min((i for i in (text.find("HTTPConnectionPool("), text.find("HTTPSConnectionPool(")) if i >= 0),
                  default=-1)
        prefix = text[:cut].rstrip(" :(") if cut > 0 else ""
        if prefix:  # our own words first ("cannot reach SGLang at ..."), then the reason instead of urllib3's repr
            text = f"{prefix}: {reason}"
        else:
            text = f"cannot reach {where.group(1)}:{where.group(2)} ({reason})" if where else f"cannot connect ({reason})"
    elif isinstance(exc, DeltafsError):
        return text  # our own messages are written as one line that says what to do: keep them whole
    else:
        text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 1] + "…"
