"""What one version holds (`show`) and how two versions differ (`diff`), read from the store only."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from deltafs.format.manifest import payload_bytes
from deltafs.format.versions import check_version
from deltafs.read.inspect import FOLD_FAILURES, TensorInfo, VersionReader, open_version, tensor_infos
from deltafs.store.repo import Repository

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FileInfo:
    path: str
    size: int
    format: str
    tensors: int
    stored: int  # bytes of the distinct payloads this version stores for the file

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class VersionInfo:
    version: int
    kind: str
    parent: int | None
    created: str
    digest: str
    chunk_bytes: int
    metadata: dict[str, Any]
    stats: dict[str, Any]
    files: list[FileInfo]
    tensors: list[TensorInfo]
    head: bool
    # Bytes of the distinct payloads this version's records name (a payload two files share counts once; one that
    # an earlier version already wrote, content-addressed, counts too).
    stored: int

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["files"] = [f.to_json() for f in self.files]
        out["tensors"] = [t.to_json() for t in self.tensors]
        return out


def show(store: str | Repository, version: int | None = None, *,
         storage_options: dict[str, Any] | None = None) -> VersionInfo:
    """Files, tensors, codecs, sizes and metadata of one version (default: HEAD)."""
    repo = store if isinstance(store, Repository) else Repository.open(store, storage_options)
    from deltafs.read.pull import resolve_version

    target = resolve_version(repo, version)
    man = repo.manifest(target)
    head = repo.head()
    files = [FileInfo(f.path, f.size, f.format, sum(1 for s in f.segments if s.kind == "tensor"),
                      payload_bytes(c for s in f.segments for c in s.chunks)) for f in man.files]
    return VersionInfo(man.version, man.kind, man.parent, man.created, man.digest, man.chunk_bytes, dict(man.metadata),
                       dict(man.stats), files, tensor_infos(man), head is not None and head.version == target,
                       payload_bytes(c for f in man.files for s in f.segments for c in s.chunks))


@dataclass(frozen=True)
class TensorDiff:
    name: str
    status: str  # "changed" | "same" | "added" | "removed" | "reshaped"
    elements: int
    changed: int  # elements whose bytes differ
    stored: int  # bytes the newer version stores for this tensor

    @property
    def fraction(self) -> float:
        return self.changed / self.elements if self.elements else 0.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["fraction"] = self.fraction
        return out


def diff(store: str | Repository, a: int, b: int, *, storage_options: dict[str, Any] | None = None,
         tensors: list[str] | None = None) -> list[TensorDiff]:
    """Per tensor: how many elements differ between versions a and b, and what b stores for it.

    Tensors whose digests are equal are not read; the others are rebuilt (digest-checked) and
    compared element by element (bitwise, so NaNs and -0.0 count as the bytes they are).
    """
    a = check_version(a, "version A")  # a usage error (exit 2), as show's and pull's --version, before the store is read
    b = check_version(b, "version B")
    repo = store if isinstance(store, Repository) else Repository.open(store, storage_options)
    ra, rb = open_version(repo, a), open_version(repo, b)
    sa = {t.name: t for t in ra.tensors()}
    sb = {t.name: t for t in rb.tensors()}
    seg_a = {seg.key[2:]: seg for f in ra.manifest.files for seg in f.segments if seg.kind == "tensor"}
    seg_b = {seg.key[2:]: seg for f in rb.manifest.files for seg in f.segments if seg.kind == "tensor"}
    names = sorted(set(sa) | set(sb)) if tensors is None else tensors
    out = []
    for name in names:
        ta, tb = sa.get(name), sb.get(name)
        if ta is None and tb is None:
            from deltafs.errors import UsageError

            raise UsageError(f"neither version {a} nor {b} has a tensor {name!r}")
        if ta is None or tb is None:
            t = tb or ta
            assert t is not None
            out.append(TensorDiff(name, "added" if ta is None else "removed", _elements(t), _elements(t),
                                  tb.stored if tb else 0))
            continue
        if ta.dtype != tb.dtype or ta.shape != tb.shape:
            out.append(TensorDiff(name, "reshaped", _elements(tb), _elements(tb), tb.stored))
            continue
        if seg_a[name].digest == seg_b[name].digest:
            out.append(TensorDiff(name, "same", _elements(tb), 0, tb.stored))
            continue
        try:
            changed = _changed_elements(ra, rb, name, tb)
        except FOLD_FAILURES as exc:  # a fold is only an accelerator: read the versions by their own chains
            plain_a, plain_b = ra.without_fold(), rb.without_fold()
            if plain_a is None and plain_b is None:
                raise
            log.warning("reading versions %s and %s without their folds (%s)", a, b, exc)
            ra, rb = plain_a or ra, plain_b or rb
            changed = _changed_elements(ra, rb, name, tb)
        out.append(TensorDiff(name, "changed" if changed else "same", _elements(tb), changed, tb.stored))
    return out


def _elements(t: TensorInfo) -> int:
    count = 1
    for d in t.shape:
        count *= d
    return count


def _changed_elements(ra: VersionReader, rb: VersionReader, name: str, t: TensorInfo) -> int:
    """Elements whose bytes differ; compared chunk by chunk (the two versions share the store's chunk grid) as
    unsigned integers of the element size, vectorized, in the memory of two chunks."""
    elements = _elements(t)
    width = t.nbytes // elements if elements else 1
    view = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}.get(width)
    if view is None or width * elements != t.nbytes:  # packed sub-byte types: count differing bytes
        view = np.uint8
    changed = 0
    for ca, cb in zip(ra.tensor_chunks(name), rb.tensor_chunks(name), strict=True):
        changed += int(np.count_nonzero(ca.view(view) != cb.view(view)))
    return changed
