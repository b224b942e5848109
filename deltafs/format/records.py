"""The small records deltafs writes besides manifests, one timestamp format, and bounded JSON. No I/O.

Every control file is read with a size limit (the *_MAX_BYTES constants; the store refuses anything
larger before reading it whole) and parsed by load_json, which fails with FormatError (exit 5) on
bad or too deeply nested JSON instead of recursing until Python gives up.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import time
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from deltafs.errors import FormatError
from deltafs.format.keys import is_valid_version


def hostname() -> str:
    """This host's name (socket is imported here: most commands never need it, and it costs ~4 ms to load)."""
    import socket

    return socket.gethostname()


# Size limits of control files, in bytes (stored and, for compressed manifests, decoded).
HEAD_MAX_BYTES = 4 << 10
CONFIG_MAX_BYTES = 64 << 10
# The largest chunk a store may declare: a reader holds a chunk-sized buffer per thread and decodes into it, so a
# store claiming more (a damaged or hostile deltafs.json) is refused before any allocation. The default is 4 MiB.
MAX_CHUNK_BYTES = 256 << 20
LOCK_MAX_BYTES = 64 << 10
FLEET_MAX_BYTES = 1 << 20
MANIFEST_MAX_BYTES = 256 << 20  # decoded canonical JSON; a 70B model at 4 MiB chunks needs ~10 MiB
DEST_STATE_MAX_BYTES = MANIFEST_MAX_BYTES + (64 << 10)
MAX_JSON_DEPTH = 32

STORE_FORMAT = "deltafs.store"
HEAD_FORMAT = "deltafs.head"
LOCK_FORMAT = "deltafs.lock"
FLEET_FORMAT = "deltafs.fleet"  # the record itself: deltafs.watch.ledger.HostStatus
DEST_STATE_FORMAT = "deltafs.local"  # the name 0.1 wrote: DESTs pulled by 0.1 stay ours

# Store config: 2 is written by this release (its manifests are v2); 1 is still read.
STORE_FORMAT_VERSION = 2
STORE_FORMAT_VERSIONS = (1, 2)
HEAD_FORMAT_VERSION = 1


_MANIFEST_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


def is_manifest_digest(value: object) -> bool:
    """A manifest's digest: sha256 of its canonical JSON without the digest field."""
    return isinstance(value, str) and bool(_MANIFEST_DIGEST.match(value))


# --- time ----------------------------------------------------------------------------------------
def utcnow() -> str:
    """Now as RFC 3339 UTC with microseconds, the one timestamp format of every record: 2026-01-31T12:00:00.000000Z."""
    return format_timestamp(time.time())


def format_timestamp(seconds: float) -> str:
    return _dt.datetime.fromtimestamp(seconds, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_timestamp(text: object) -> float | None:
    """Seconds since the epoch of a record's timestamp (also the second-resolution form of older records), or None."""
    if not isinstance(text, str):
        return None
    for fmt in ("%Y-%m-%dT%H:%M:%S.%fZ", "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return _dt.datetime.strptime(text, fmt).replace(tzinfo=_dt.timezone.utc).timestamp()
        except ValueError:
            continue
    return None


# --- JSON ------------------------------------------------------------------------------------------
def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8: the same record always gives the same bytes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


DENSE_JSON_FROM = 1 << 20  # records at least this long are checked for their density of values
MIN_BYTES_PER_VALUE = 8


def _check_size(data: bytes, what: str, max_bytes: int | None) -> None:
    if max_bytes is not None and len(data) > max_bytes:
        raise FormatError(f"{what} is {len(data)} bytes, more than the {max_bytes} a valid one can be")
    if len(data) > DENSE_JSON_FROM:
        # Parsed JSON costs ~60 bytes per value: 250 MiB of "[]," took 6.8 GB before the structure was even looked
        # at. deltafs's records hold a value per 12-17 bytes of text; refuse text far denser than that, unparsed.
        values = data.count(b",")  # values in arrays and objects are comma-separated (nesting is bounded below)
        if values * MIN_BYTES_PER_VALUE > len(data):
            raise FormatError(f"{what} holds {values} JSON values in {len(data)} bytes, far more than a deltafs record "
                              "of its size (a damaged or hostile store)")


def check_readable(data: bytes, what: str, *, max_bytes: int | None = None, max_depth: int = MAX_JSON_DEPTH) -> None:
    """FormatError unless load_json(data, ...) would take this valid JSON text: what a writer checks before it
    stores a record, so that it never stores one every reader refuses (metadata nested 150 levels deep was
    committed, and every pull, log and gc of the store then failed on the newest manifest)."""
    _check_size(data, what, max_bytes)
    if text_depth(data, max_depth) > max_depth:
        raise FormatError(f"{what} is nested more than {max_depth} levels deep")


def could_make_dense(part: bytes) -> bool:
    """Whether JSON text `part`, inside a record whose other text holds at most a value per 12 bytes (deltafs's
    manifests hold one per 12-17), could make that record one load_json refuses as too dense: a record of
    DENSE_JSON_FROM bytes or more with a value per fewer than MIN_BYTES_PER_VALUE bytes. With v values in n bytes
    here and R bytes of the rest, refused when n + R > DENSE_JSON_FROM and 8(v + R/12) > n + R, so for some R
    exactly when 8v > n and 3(8v - n) > DENSE_JSON_FROM - n."""
    n, v = len(part), part.count(b",")
    return MIN_BYTES_PER_VALUE * v > n and 3 * (MIN_BYTES_PER_VALUE * v - n) > DENSE_JSON_FROM - n


def load_json(data: bytes, what: str, *, max_bytes: int | None = None, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse data as JSON; FormatError naming `what` when it is too large, malformed or nested deeper than max_depth."""
    _check_size(data, what, max_bytes)
    try:
        value = json.loads(data, parse_constant=_no_constant)
    except RecursionError:
        raise FormatError(f"{what} is nested too deeply to be a deltafs record") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise FormatError(f"{what} is not valid JSON: {exc}") from None
    if text_depth(data, max_depth) > max_depth:
        raise FormatError(f"{what} is nested more than {max_depth} levels deep")
    if (b"\\u" in data or b"\xed" in data) and _SURROGATE_ESCAPE.search(data) and not _encodable(value):
        # JSON may escape a lone UTF-16 surrogate (\ud800), which no UTF-8 text holds (json.loads also takes one
        # encoded as if it could be): a file name or metadata
        # value that cannot be created, printed or written back. Checked only where an escape of one occurs.
        raise FormatError(f"{what} holds a string that is not valid Unicode (a lone surrogate escape)")
    return value


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")  # escaped, or encoded as UTF-8 would not


def _encodable(value: Any) -> bool:
    return is_unicode(json.dumps(value, ensure_ascii=False))


def is_unicode(text: str) -> bool:
    """Whether text can be written as UTF-8: no lone surrogate (a name read from bytes that were not UTF-8, or a JSON
    escape of half a character). The one check for names deltafs stores: file paths, tensor names, metadata."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_NOT_SPECIAL = bytes(b for b in range(256) if b not in b'"[]{}\\')
_TO_PARENS = bytes.maketrans(b"[{]}", b"(())")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")  # NaN and Infinity: json.loads takes them, JSON does not


def text_depth(data: bytes | str, cap: int | None = None) -> int:
    """Nesting depth of valid JSON text, from its brackets outside strings; with cap, at most cap + 1.

    Only C-level bytes operations, a few per level: 15 ms for a 70B model's 10.5 MB manifest, where walking the
    parsed value or accumulating a running depth over its 356,000 brackets costs 0.1-0.2 s.
    """
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if b"\\" in raw:
        brackets = _JSON_STRING.sub(b"", raw).translate(_TO_PARENS, _NOT_BRACKET)
    else:
        # Without a backslash no string holds an escaped quote. Keep only quotes and brackets; two quotes with
        # nothing between them change no other character's side of a string boundary, so they go first (nearly
        # all of them); then every other quote-separated piece is outside strings.
        marks = raw.translate(None, _NOT_SPECIAL).replace(b'""', b"")
        if b'"' in marks:
            marks = b"".join(marks.split(b'"')[::2])
        brackets = marks.translate(_TO_PARENS)
    # Valid JSON pairs its brackets: each pass drops the innermost pairs, so the passes count the depth.
    depth = 0
    while brackets and (cap is None or depth <= cap):
        inner = brackets.replace(b"()", b"")
        if len(inner) == len(brackets):
            break
        brackets, depth = inner, depth + 1
    return depth


def _object(data: bytes, what: str, fmt: str, max_bytes: int, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    raw = load_json(data, what, max_bytes=max_bytes, max_depth=max_depth)
    if not isinstance(raw, dict) or raw.get("format") != fmt:
        raise FormatError(f"{what} is not a {fmt} record")
    return raw


# --- store config and HEAD ----------------------------------------------------------------------
@dataclass(frozen=True)
class StoreConfig:
    """The store's fixed identity and parameters, written once at creation (deltafs.json)."""

    store_id: str
    chunk_bytes: int
    created: str
    format_version: int = STORE_FORMAT_VERSION

    def to_bytes(self) -> bytes:
        return canonical_json({"format": STORE_FORMAT, "format_version": self.format_version, "store_id": self.store_id,
                               "chunk_bytes": self.chunk_bytes, "created": self.created})

    @classmethod
    def from_bytes(cls, data: bytes) -> StoreConfig:
        raw = _object(data, "store config deltafs.json", STORE_FORMAT, CONFIG_MAX_BYTES)
        fv = raw.get("format_version")
        if fv not in STORE_FORMAT_VERSIONS or isinstance(fv, bool):
            raise FormatError(f"unknown store format version {fv!r} (this deltafs reads {', '.join(map(str, STORE_FORMAT_VERSIONS))})")
        cb = raw.get("chunk_bytes")
        if not isinstance(cb, int) or isinstance(cb, bool) or cb <= 0 or cb % 8 or cb > MAX_CHUNK_BYTES:
            raise FormatError(f"deltafs.json: chunk_bytes must be a positive multiple of 8 of at most {MAX_CHUNK_BYTES} "
                              f"(256 MiB), got {cb!r}")
        sid = raw.get("store_id")
        if not isinstance(sid, str) or not sid:
            raise FormatError("deltafs.json: store_id must be a non-empty string")
        return cls(store_id=sid, chunk_bytes=cb, created=str(raw.get("created")), format_version=fv)


@dataclass(frozen=True)
class Head:
    """The one mutable pointer: the newest committed version and its manifest digest."""

    version: int
    digest: str

    def to_bytes(self) -> bytes:
        return canonical_json({"format": HEAD_FORMAT, "format_version": HEAD_FORMAT_VERSION, "version": self.version,
                               "digest": self.digest})

    @classmethod
    def from_bytes(cls, data: bytes) -> Head:
        raw = _object(data, "HEAD", HEAD_FORMAT, HEAD_MAX_BYTES)
        if raw.get("format_version") != HEAD_FORMAT_VERSION:
            raise FormatError(f"unknown HEAD format version {raw.get('format_version')!r}")
        v, d = raw.get("version"), raw.get("digest")
        if not is_valid_version(v):
            raise FormatError(f"HEAD is malformed: version {v!r} is not a version number")
        if not is_manifest_digest(d):
            raise FormatError(f"HEAD is malformed: digest {str(d)[:80]!r} is not sha256:<64 hex digits>")
        return cls(version=v, digest=d)  # type: ignore[arg-type]


# --- store lock -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LockRecord:
    """Who holds a store lock (locks/<name>.json) and since when (seconds since the epoch)."""

    owner: str  # random id of this acquisition
    host: str
    pid: int
    created: float
    purpose: str
    ns: str | None = None  # which processes pid names (boot and pid namespace; store.lock.process_space)

    @classmethod
    def mine(cls, owner: str, purpose: str, ns: str | None = None) -> LockRecord:
        return cls(owner, hostname(), os.getpid(), time.time(), purpose, ns)

    def to_bytes(self) -> bytes:
        return canonical_json({"format": LOCK_FORMAT, "owner": self.owner, "host": self.host, "pid": self.pid,
                               "created": self.created, "purpose": self.purpose,
                               **({"ns": self.ns} if self.ns else {})})

    @classmethod
    def from_bytes(cls, data: bytes) -> LockRecord:
        raw = load_json(data, "lock record", max_bytes=LOCK_MAX_BYTES)
        if not isinstance(raw, dict):
            raise FormatError("lock record is not a JSON object")
        try:
            ns = raw.get("ns")
            return cls(str(raw["owner"]), str(raw["host"]), int(raw["pid"]), float(raw["created"]),
                       str(raw.get("purpose", "?")), ns if isinstance(ns, str) else None)
        except (KeyError, TypeError, ValueError):
            raise FormatError("lock record is malformed") from None


# --- DEST state (beside a pulled version directory) ------------------------------------------------
def dest_state_record(*, store_id: str, store_url: str, version: int, digest: str,
                      files: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """The members of the state record written next to an installed version directory (vNNNNNNNNNN-xxxxxxxx.json)
    other than its manifest: what read_version_state returns beside the Manifest.

    files: path -> [size, mtime_ns] as installed, so a later pull notices an edited file cheaply.
    """
    record: dict[str, Any] = {"format": DEST_STATE_FORMAT, "store_id": store_id, "store_url": store_url,
                              "version": version, "digest": digest, "installed": utcnow()}
    if files is not None:
        record["files"] = files
    return record


def dest_state_bytes(record: dict[str, Any], manifest_text: bytes) -> bytes:
    """The state record's bytes: record (dest_state_record) with the manifest's canonical JSON (Manifest.to_bytes())
    as its "manifest" member, embedded verbatim.

    The result is what canonical_json would make of the record with the manifest parsed, without parsing and
    encoding the manifest again (0.62 s for a 70B model's 35,000 chunk records; docs/profile.md, round 6).
    """
    text = canonical_json({**record, "manifest": 0})
    # Sorted keys: only store_id, store_url and version (strings, in which a quote is escaped, and an integer)
    # follow "manifest", so its last occurrence with the placeholder is the member itself.
    at = text.rindex(b'"manifest":0,"store_id":') + len(b'"manifest":')
    return text[:at] + manifest_text + text[at + 1:]


def embedded_manifest_text(state: bytes) -> bytes | None:
    """The text of the "manifest" member of a state record written by dest_state_bytes, or None.

    A guess to check, never trusted: the caller uses it only if the record's other members and this text encode
    back to exactly the record's bytes (so it is the member json.loads kept), and then checks the manifest's digest
    on it. "files" (paths to lists) sorts before "manifest", and a quote in a string is escaped, so in such a
    record the first '"manifest":{' is the member and the last ',"store_id":"' ends it.
    """
    span = embedded_manifest_span(state)
    return state[span[0]:span[1]] if span is not None else None


def embedded_manifest_span(state: bytes) -> tuple[int, int] | None:
    """Where embedded_manifest_text's guess lies in state: (start, end), or None."""
    start = state.find(b'"manifest":{')
    end = state.rfind(b',"store_id":"')
    return (start + len(b'"manifest":'), end) if 0 <= start < end else None


def parse_dest_state(data: bytes) -> dict[str, Any]:
    """A DEST state record as a dict with store_id, store_url, version, digest and manifest; FormatError otherwise."""
    # One level deeper than a manifest, which it holds under "manifest": a manifest readers take is never refused
    # here (metadata 31 levels deep made the DEST that pulled it unreadable: exit 9 at the next pull).
    raw = _object(data, "DEST state record", DEST_STATE_FORMAT, DEST_STATE_MAX_BYTES, MAX_JSON_DEPTH + 1)
    if not all(isinstance(raw.get(k), str) for k in ("store_id", "store_url", "digest")) \
            or not isinstance(raw.get("version"), int) or not isinstance(raw.get("manifest"), dict):
        raise FormatError("DEST state record is malformed")
    return raw


@dataclass
class HostStatus:
    """What one rollout host serves and how its last sync went: the fleet record fleet/<host-id>.json.

    Written by the watcher (deltafs.watch.ledger), read by `deltafs status`; unknown fields are ignored.
    """

    host_id: str
    dest: str
    engine: str  # "sglang", "torch", "none"
    engine_url: str | None = None
    store_id: str | None = None
    state: str = "starting"
    served_version: int | None = None
    staged_version: int | None = None
    last_error: str | None = None
    last_error_at: str | None = None
    failures: int = 0  # consecutive failed cycles; 0 when the last one went through
    last_sync: dict[str, Any] | None = None  # {"version", "pause_s", "sync_s", "at", "fallback"}
    engine_group: str | None = None  # hosts of one multi-node engine share a group name
    engine_hosts: int = 1  # how many hosts the group has
    group_wait: str | None = None  # why the group's switch waits, in words
    needs_restart: dict[str, Any] | None = None  # {"version", "reason"}: staged, but only a restart can serve it
    checksums: dict[str, str] = field(default_factory=dict)  # weight version -> loaded-weight checksum
    # Engine groups: the versions this host has ready to load under DEST.deltafs/by-version/ (what a group's switch
    # needs from every host); None from a watcher that predates the field.
    held: list[int] | None = None
    started_at: str = field(default_factory=utcnow)
    updated_at: str = field(default_factory=utcnow)
    hostname: str = field(default_factory=hostname)
    pid: int = field(default_factory=os.getpid)

    def to_bytes(self) -> bytes:
        body = {"format": FLEET_FORMAT, "format_version": 1, **asdict(self)}
        return canonical_json(body)

    @classmethod
    def from_bytes(cls, data: bytes) -> HostStatus:
        raw = load_json(data, "fleet record", max_bytes=FLEET_MAX_BYTES)  # FormatError when deep or huge
        if not isinstance(raw, dict) or raw.get("format") != FLEET_FORMAT:
            raise ValueError("not a deltafs fleet record")
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in known}
        for f in fields(cls):
            kind, nullable = _HOST_STATUS_TYPES[f.name]
            if f.name in values and not _is_of(values[f.name], kind, nullable):
                want = kind.__name__ + (" or null" if nullable else "")
                raise ValueError(f"fleet record field {f.name} is {type(values[f.name]).__name__}, not {want}")
            if f.name not in values and f.default is MISSING and f.default_factory is MISSING:
                raise ValueError(f"fleet record lacks {f.name}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in values.get("checksums", {}).items()):
            raise ValueError("fleet record checksums must map versions to strings")
        held = values.get("held")
        if held is not None and not all(_is_of(v, int) for v in held):
            raise ValueError("fleet record held must list integer versions")
        sync = values.get("last_sync")
        if sync is not None and not (_is_of(sync.get("version"), int) and all(
                _is_of(sync.get(k), float) for k in ("pause_s", "sync_s"))):
            raise ValueError("fleet record last_sync needs an integer version and numbers pause_s and sync_s")
        restart = values.get("needs_restart")
        if restart is not None and not (_is_of(restart.get("version"), int) and _is_of(restart.get("reason"), str)):
            raise ValueError("fleet record needs_restart needs an integer version and a reason")
        return cls(**values)


# What each HostStatus member may hold in a record another host wrote (a wrong type crashed status and the group
# watchers that compare versions): its type, and whether null is allowed. Which members must be there is the
# dataclass's own say (those without a default).
_HOST_STATUS_TYPES: dict[str, tuple[type, bool]] = {
    "host_id": (str, False), "dest": (str, False), "engine": (str, False), "engine_url": (str, True),
    "store_id": (str, True), "state": (str, False), "served_version": (int, True), "staged_version": (int, True),
    "last_error": (str, True), "last_error_at": (str, True), "failures": (int, False), "last_sync": (dict, True),
    "engine_group": (str, True), "engine_hosts": (int, False), "group_wait": (str, True), "needs_restart": (dict, True),
    "checksums": (dict, False), "held": (list, True), "started_at": (str, False), "updated_at": (str, False), "hostname": (str, False),
    "pid": (int, False),
}


def _is_of(value: Any, kind: type, nullable: bool = False) -> bool:
    """value is of kind (int: never a bool; float: any number but a bool), or None where nullable."""
    if value is None:
        return nullable
    if isinstance(value, bool):
        return kind is bool
    return isinstance(value, (int, float)) if kind is float else isinstance(value, kind)
