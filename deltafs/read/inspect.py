"""Read-only looks into a store: one tensor without a pull, and what a pull would read.

`open_version` rebuilds only the chunks of the tensors asked for (each digest checked), so a
trainer or an evaluation job can read `lm_head.weight` of version 812 without materializing the
checkpoint. `plan_pull` answers "what would `deltafs pull` do" without writing anything.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from collections.abc import Iterator
from typing import Any

import numpy as np

from deltafs.errors import FormatError, IntegrityError, ObjectNotFoundError, UsageError
from deltafs.format.dtypes import NUMPY_NAMES, TORCH_NAMES
from deltafs.format.manifest import FileEntry, Manifest, Segment, payload_bytes
from deltafs.format.versions import check_version
from deltafs.read.dest import LocalCheckpoint
from deltafs.read.chain import MAX_BRIDGES, Chain, chain_objects, plan_chain
from deltafs.read.rebuild import Builder, ChunkSource
from deltafs.store.repo import Repository

log = logging.getLogger(__name__)

# What a fold can fail with; the version's own chain then still reads it (FORMAT.md, "Folded deltas").
FOLD_FAILURES = (IntegrityError, ObjectNotFoundError, FormatError)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    stored: int  # bytes of the payloads this version stores for the tensor (0 when unchanged; a payload it shares
    # with another tensor, identical chunks stored once, counts for each of them)
    codecs: dict[str, int]  # codec name -> number of chunks

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["shape"] = list(self.shape)
        return out


def tensor_infos(man: Manifest) -> list[TensorInfo]:
    """Every tensor of a version with its size and how this version stores it."""
    out = []
    for f in man.files:
        for seg in f.segments:
            if seg.kind != "tensor":
                continue
            codecs: dict[str, int] = {}
            for c in seg.chunks:
                codecs[c.name] = codecs.get(c.name, 0) + 1
            out.append(TensorInfo(seg.key[2:], f.path, seg.dtype or "", tuple(seg.shape or ()), seg.size,
                                  payload_bytes(seg.chunks), codecs))
    return out


class VersionReader:
    """One committed version, read tensor by tensor from the store (no checkpoint is written)."""

    def __init__(self, repo: Repository, chain: Chain) -> None:
        self.repo = repo
        self.manifest = chain.target
        self._chain = chain
        self._builder = Builder(repo, chain, ChunkSource(repo, None))
        self._segments = {seg.key[2:]: (f, seg) for f in self.manifest.files for seg in f.segments
                          if seg.kind == "tensor"}

    @property
    def version(self) -> int:
        return self.manifest.version

    def tensors(self) -> list[TensorInfo]:
        return tensor_infos(self.manifest)

    def tensor_names(self) -> list[str]:
        return list(self._segments)

    def tensor_bytes(self, name: str) -> bytes:
        """The tensor's raw little-endian bytes, digest-checked."""
        f, seg = self._find(name)
        return self._segment_bytes(f, seg)

    def without_fold(self) -> VersionReader | None:
        """A reader of the same version by its own chain when this one reads it through a fold, else None."""
        if self._chain.final is None:
            return None
        return VersionReader(self.repo, plan_chain(self.repo, self.version, None))

    def tensor_chunks(self, name: str) -> Iterator[np.ndarray]:
        """The tensor's bytes chunk by chunk (see Builder.segment_chunks: each view valid until the next; the digest
        is checked after the last, so trust what they say only once the iteration ended). Read through the fold when
        there is one: a failure is raised, and without_fold() gives a reader that does without it."""
        f, seg = self._find(name)
        return self._builder.segment_chunks(f, seg)

    def tensor(self, name: str, *, framework: str = "numpy") -> Any:
        """The tensor as a numpy array (framework="numpy") or a torch tensor (framework="torch")."""
        f, seg = self._find(name)
        data = self._segment_bytes(f, seg)
        shape = tuple(seg.shape or ())
        if framework == "torch":
            import torch

            dtype = getattr(torch, TORCH_NAMES.get(seg.dtype or "", ""), None)
            if dtype is None:
                raise UsageError(f"tensor {name} is {seg.dtype}, which this torch lacks: use tensor_bytes()")
            if not data:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)
        if framework != "numpy":
            raise UsageError(f"framework must be 'numpy' or 'torch', not {framework!r}")
        np_name = NUMPY_NAMES.get(seg.dtype or "")
        if np_name is None:
            raise UsageError(f"tensor {name} is {seg.dtype}, which numpy lacks: use framework='torch' or tensor_bytes()")
        return np.frombuffer(data, dtype=np.dtype(np_name)).reshape(shape)

    def _find(self, name: str) -> tuple[FileEntry, Segment]:
        try:
            return self._segments[name]
        except KeyError:
            raise UsageError(f"version {self.version} has no tensor {name!r}") from None

    def _segment_bytes(self, f: FileEntry, seg: Segment) -> bytes:
        try:
            return self._builder.segment_bytes(f, seg)
        except FOLD_FAILURES as exc:
            plain = self.without_fold()
            if plain is None:
                raise
            log.warning("reading version %s without its fold (%s)", self.version, exc)
            self._chain, self._builder = plain._chain, plain._builder  # and for every later read
            return self._builder.segment_bytes(f, seg)


def open_version(store: str | Repository, version: int | None = None, *,
                 storage_options: dict[str, Any] | None = None) -> VersionReader:
    """A read-only view of one version (default: HEAD) whose tensors are rebuilt on demand."""
    if version is not None:
        version = check_version(version)
    repo = store if isinstance(store, Repository) else Repository.open(store, storage_options)
    from deltafs.read.pull import resolve_version

    target = resolve_version(repo, version)
    return VersionReader(repo, plan_chain(repo, target, None, folds=True))


@dataclass(frozen=True)
class PullPlan:
    """What `deltafs pull` would do now, computed without writing anything."""

    version: int
    current: int | None  # the version DEST holds, if any
    up_to_date: bool
    steps: list[dict[str, Any]]  # the manifests applied, oldest first: version, kind, fold, bridge
    objects: int  # chunk objects to fetch
    bytes_to_read: int  # their stored size
    bytes_out: int  # bytes of the checkpoint written or linked
    files_linked: int  # files identical to DEST's, linked rather than rebuilt

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def plan_pull(store: str | Repository, dest: str, *, version: int | None = None,
              storage_options: dict[str, Any] | None = None) -> PullPlan:
    """The chain, objects and bytes a pull into DEST would read (DEST is not locked or changed)."""
    from deltafs.read.pull import resolve_version

    repo = store if isinstance(store, Repository) else Repository.open(store, storage_options)
    state = LocalCheckpoint(dest).state()
    if state is not None and state.store_id != repo.store_id:
        state = None  # a pull would refuse (or, with --force, start from a full version)
    target = resolve_version(repo, version)
    if state is not None and state.version == target and repo.manifest(target).digest == state.digest:
        man = repo.manifest(target)
        return PullPlan(target, state.version, True, [], 0, 0, man.raw_bytes, 0)
    chain = plan_chain(repo, target, state, folds=True, bridges=MAX_BRIDGES)
    final = chain.target
    local_files = {(lf.digest, lf.size) for lf in state.manifest.files} if state is not None else set()
    linked = [f for f in final.files if (f.digest, f.size) in local_files
              and os.path.exists(os.path.join(state.path, f.path))] if state is not None else []
    linked_paths = {f.path for f in linked}
    needed = chain_objects(chain.steps, skip_files=frozenset(linked_paths))
    steps = [{"version": m.version, "kind": m.kind, "fold": m is not final and "fold_of" in m.stats,
              "bridge": m is not final and "bridge_of" in m.stats} for m in chain.steps]
    return PullPlan(target, state.version if state else None, False, steps, len(needed), sum(needed.values()),
                    final.raw_bytes, len(linked))

