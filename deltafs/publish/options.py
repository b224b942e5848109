"""What a push is asked to do (PushOptions) and what it did (PushResult)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, TypedDict

from deltafs.defaults import (DEFAULT_FULL_LEVEL, DEFAULT_KEYFRAME_BUDGET, DEFAULT_KEYFRAME_EVERY, DEFAULT_LEVEL,
                              MAX_LEVEL, MIN_LEVEL)
from deltafs.format.versions import check_version
from deltafs.errors import FormatError, UsageError, check_count
from deltafs.format.manifest import canonical_json
from deltafs.format.records import MANIFEST_MAX_BYTES, MAX_JSON_DEPTH, check_readable, could_make_dense, text_depth

# How the push cache takes a pushed file: "auto" tries a reflink (copy-on-write clone), then a hard
# link, then an in-kernel copy; "copy" never links (for trainers that rewrite checkpoint files in
# place; deltafs also falls back to it by itself once it sees that happen).
LINK_MODES = ("auto", "copy")


@dataclass(frozen=True)
class PushOptions:
    """Everything a push can be told besides the store and the source; shared by every push entry point."""

    version: int | None = None  # the new version's number; default: HEAD + 1
    metadata: Mapping[str, Any] = field(default_factory=dict)  # JSON, stored in the manifest (e.g. the step)
    full: bool = False  # write a full version even if a delta is possible
    keyframe_every: int | None = DEFAULT_KEYFRAME_EVERY  # a full version at least every N versions
    keyframe_budget: float | None = DEFAULT_KEYFRAME_BUDGET  # ... or once deltas since the last one reach this x full
    level: int = DEFAULT_LEVEL  # zstd level of the delta chunks' payloads
    full_level: int = DEFAULT_FULL_LEVEL  # zstd level of chunks stored without a base (full versions, new tensors)
    threads: int | None = None  # encoding threads; default deltafs.parallel.default_threads()
    fold: bool = False  # also write a folded delta from the last full version (deltafs.read.chain)
    bridge: bool = True  # a full version with a parent also gets its bridge: a delta against that parent
    cache_dir: str | None = None  # the push cache; default $DELTAFS_CACHE or ~/.cache/deltafs/push/<store id>
    storage_options: Mapping[str, Any] | None = None  # fsspec options when the store is given as a URL
    progress: bool = False  # a progress bar on stderr
    link: str = "auto"  # see LINK_MODES

    def __post_init__(self) -> None:
        if self.version is not None:  # before anything is written: a bad number never reaches the store
            object.__setattr__(self, "version", check_version(self.version))  # an int (numpy's integers too)
        try:
            text = canonical_json(dict(self.metadata))
        except (TypeError, ValueError) as exc:
            raise UsageError(f"metadata is not JSON: {exc}") from None
        except RecursionError:
            text = None
        # Inside the manifest, one level down: readers refuse a manifest nested more than MAX_JSON_DEPTH deep.
        if text is None or text_depth(text, MAX_JSON_DEPTH) > MAX_JSON_DEPTH - 1:
            raise UsageError(f"metadata is nested more than {MAX_JSON_DEPTH - 1} levels deep") from None
        try:
            check_readable(text, "metadata", max_bytes=MANIFEST_MAX_BYTES // 2)
        except FormatError as exc:  # the manifest is checked whole before the commit too (Manifest.sealed)
            raise UsageError(f"{str(exc).partition(' (')[0]}: readers would refuse the manifest; store large data "
                             "as a file of the checkpoint") from None
        if could_make_dense(text):  # metadata just under 1 MiB passed the check above, then failed the seal
            raise UsageError(f"metadata holds {text.count(b',')} JSON values in {len(text)} bytes: readers would refuse "
                             "a manifest of it (one of 1 MiB or more with a value per fewer than 8 bytes); store large "
                             "data as a file of the checkpoint")
        if self.link not in LINK_MODES:
            raise UsageError(f"link must be one of {', '.join(LINK_MODES)}, not {self.link!r}")
        if self.threads is not None:
            check_count(self.threads, "threads", 1)
        for name in ("level", "full_level"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not MIN_LEVEL <= value <= MAX_LEVEL:
                raise UsageError(f"{name} must be a zstd level, {MIN_LEVEL}..{MAX_LEVEL}, not {value!r}")

    @classmethod
    def of(cls, options: PushOptions | None = None, **overrides: Any) -> PushOptions:
        """options (or the defaults) with keyword overrides; an unknown keyword is a TypeError, as for a function."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unexpected push option {unknown[0]!r}")
        overrides = {k: v for k, v in overrides.items() if not (k == "metadata" and v is None)}
        return replace(options or cls(), **overrides)


class PushKeywords(TypedDict, total=False):
    """PushOptions' fields as keyword arguments: push(store, src, version=3, fold=True) still works."""

    version: int | None
    metadata: Mapping[str, Any] | None
    full: bool
    keyframe_every: int | None
    keyframe_budget: float | None
    level: int
    full_level: int
    threads: int | None
    fold: bool
    bridge: bool
    cache_dir: str | None
    storage_options: Mapping[str, Any] | None
    progress: bool
    link: str


@dataclass(frozen=True)
class PushResult:
    version: int
    kind: str
    parent: int | None
    bytes_written: int  # new bytes stored for this version: chunks plus manifest
    full_bytes: int  # size of the checkpoint's files
    chunks_written: int
    changed_fraction: float  # elements that differ from the parent version
    seconds: float
    store: str
    base_rederived: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    fold_bytes: int = 0  # bytes of the folded delta written after the commit (fold=True)
    bridge_bytes: int = 0  # bytes of a full version's bridge (chunks and manifest), written before the commit
    digest: str | None = None  # the committed manifest's digest ("sha256:..."), as `deltafs log --json` shows it

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ratio"] = round(self.full_bytes / self.bytes_written, 2) if self.bytes_written else None
        return out


__all__ = ["DEFAULT_KEYFRAME_BUDGET", "DEFAULT_KEYFRAME_EVERY", "LINK_MODES", "PushKeywords", "PushOptions",
           "PushResult"]
