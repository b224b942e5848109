"""Multi-rank push: every rank encodes and writes the chunks of the tensors it owns; one rank commits.

    import torch.distributed as dist
    from deltafs.publish.distributed import push_distributed

    mine = {name: t for name, t in hf_state.items() if owner(name) == dist.get_rank()}
    res = push_distributed("s3://bucket/run-7", mine, extra_files={"config.json": cfg})  # on every rank

Protocol (all steps are collectives over `group`; every rank gets the same outcome):
1. Each rank describes what it owns (names, dtypes, shapes, extra file digests); all ranks check the
   union: a tensor owned by two ranks, a file given with different bytes -> UsageError everywhere,
   before anything is written.
2. The root rank reads HEAD, picks the version number and its kind (full or delta; keyframe policy
   as in publish.push) and broadcasts them.
3. Each rank writes its tensors as its own shard `model-<r+1>-of-<R>.safetensors` (plus the extra
   files it is the first to name; the root also writes model.safetensors.index.json), encodes them
   against its base (a per-rank push cache, re-derived from the store when missing or stale) and
   writes their chunks. Then every rank reports its file entries.
4. Only if every rank succeeded does the root build the manifest and commit it (the commit point);
   the outcome is broadcast. A rank that fails or dies before step 4 leaves chunks that no manifest
   references (gc removes them) and no visible version; the next push simply starts over.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from deltafs import codec
from deltafs.errors import DeltafsError, UsageError
from deltafs.format.manifest import FileEntry, Head, Manifest, canonical_json
from deltafs.format.versions import check_version
from deltafs.read.pull import checked_head
from deltafs.read.dest import LocalCheckpoint, LocalState
from deltafs.parallel import default_threads
from deltafs.publish.push import (
    DEFAULT_KEYFRAME_BUDGET,
    DEFAULT_KEYFRAME_EVERY,
    PushResult,
    _Encoder,
    _keyframe_due,
    commit_version,
    default_cache_dir,
)
from deltafs.read.rebuild import Builder, Chain, ChunkSource, LocalBaseError, plan_chain
from deltafs.publish.source import scan_source
from deltafs.store.repo import Repository

INDEX_FILE = "model.safetensors.index.json"


class DistributedPushError(DeltafsError, RuntimeError):
    """Another rank failed, so this version was not committed."""


def shard_name(rank: int, world: int) -> str:
    """The deterministic file name of a rank's tensors (HF's sharded-checkpoint convention)."""
    return f"model-{rank + 1:05d}-of-{world:05d}.safetensors"


# --- communication -------------------------------------------------------------------------------
class _Comm:
    """The three collectives the protocol needs, over a torch.distributed group or a single process."""

    def __init__(self, group: Any, root: int) -> None:
        import torch.distributed as dist

        self.dist = dist if dist.is_available() and dist.is_initialized() else None
        self.group = group
        if self.dist is None:
            self.rank, self.world, self.root_global = 0, 1, 0
        else:
            self.rank = dist.get_rank(group)
            if self.rank < 0:
                raise UsageError("push_distributed was called on a rank that is not in the given group")
            self.world = dist.get_world_size(group)
            self.root_global = dist.get_global_rank(group, root) if group is not None else root
        if not 0 <= root < self.world:
            raise UsageError(f"root rank {root} is not in a group of {self.world} ranks")
        self.root = root

    @property
    def is_root(self) -> bool:
        return self.rank == self.root

    def all_gather(self, obj: Any) -> list[Any]:
        if self.dist is None:
            return [obj]
        out: list[Any] = [None] * self.world
        try:
            self.dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as exc:
            raise _broken(exc) from exc
        return out

    def broadcast(self, obj: Any) -> Any:
        if self.dist is None:
            return obj
        box = [obj]
        try:
            self.dist.broadcast_object_list(box, src=self.root_global, group=self.group)
        except RuntimeError as exc:
            raise _broken(exc) from exc
        return box[0]


def _broken(exc: RuntimeError) -> DistributedPushError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return DistributedPushError(f"the process group failed (a rank died or hung?): {first[:300]}; version not committed")


@dataclass
class _Failure:
    """A rank's exception, as sent to the other ranks."""

    rank: int
    kind: str
    message: str

    @classmethod
    def of(cls, rank: int, exc: BaseException) -> _Failure:
        return cls(rank, type(exc).__name__, str(exc))


def _raise_first(results: list[Any], comm: _Comm, own: BaseException | None, what: str) -> None:
    """If any rank failed: re-raise this rank's own error, or a DistributedPushError naming the first failure."""
    failures = [r for r in results if isinstance(r, _Failure)]
    if not failures:
        return
    if own is not None:
        raise own
    f = failures[0]
    raise DistributedPushError(f"{what}: rank {f.rank} failed ({f.kind}: {f.message}); version not committed")


def _collective(comm: _Comm, what: str, fn: Callable[[], Any]) -> list[Any]:
    """Run fn on every rank and all-gather the results; any failure raises on every rank."""
    own: BaseException | None = None
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - sent to the other ranks, then re-raised
        own, value = exc, _Failure.of(comm.rank, exc)
    results = comm.all_gather(value)
    _raise_first(results, comm, own, what)
    return results


def _from_root(comm: _Comm, what: str, fn: Callable[[], Any]) -> Any:
    """Run fn on the root and broadcast its result; a failure there raises on every rank."""
    own: BaseException | None = None
    value: Any = None
    if comm.is_root:
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001
            own, value = exc, _Failure.of(comm.rank, exc)
    value = comm.broadcast(value)
    _raise_first([value], comm, own, what)
    return value


# --- step 1: what every rank owns ----------------------------------------------------------------
@dataclass
class _Owned:
    tensors: list[tuple[str, str, tuple[int, ...], int]]  # name, safetensors dtype, shape, bytes
    files: dict[str, tuple[str, int]]  # extra file path -> (sha256, size)


def _describe(tensors: Mapping[str, Any], extra_files: Mapping[str, bytes]) -> _Owned:
    import torch
    from safetensors.torch import _TYPES  # safetensors' own dtype table: what save_file accepts

    names = {v: k for k, v in _TYPES.items()}
    out = []
    for name, t in tensors.items():
        if not isinstance(name, str) or not name:
            raise UsageError(f"tensor names must be non-empty strings, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise UsageError(f"{name} is not a torch.Tensor")
        if t.dtype not in names:
            raise UsageError(f"{name} has dtype {t.dtype}, which safetensors cannot store")
        out.append((name, names[t.dtype], tuple(t.shape), t.numel() * t.element_size()))
    files = {}
    for path, data in extra_files.items():
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise UsageError(f"extra file {path} must be bytes")
        files[path] = (hashlib.sha256(data).hexdigest(), len(data))
    return _Owned(out, files)


@dataclass
class _Layout:
    """Who writes what, computed identically on every rank from all ranks' _Owned."""

    shard_of: dict[int, str]  # rank -> shard file name (ranks without tensors write none)
    weight_map: dict[str, str]  # tensor -> shard file name
    file_writer: dict[str, int]  # extra file path -> the rank that writes it
    total_size: int
    full_bytes: int  # estimate of the version's size, for the keyframe budget


def _layout(owned: list[_Owned], world: int) -> _Layout:
    problems = []
    owner: dict[str, tuple[int, str, tuple[int, ...]]] = {}
    weight_map: dict[str, str] = {}
    shard_of: dict[int, str] = {}
    total = 0
    for rank, o in enumerate(owned):
        if o.tensors:
            shard_of[rank] = shard_name(rank, world)
        for name, dtype, shape, nbytes in o.tensors:
            if name in owner:
                r0, d0, s0 = owner[name]
                detail = f"; their shapes disagree ({d0}{list(s0)} vs {dtype}{list(shape)})" if (d0, s0) != (dtype, shape) else ""
                problems.append(f"tensor {name} is owned by ranks {r0} and {rank}{detail}")
                continue
            owner[name] = (rank, dtype, shape)
            weight_map[name] = shard_of[rank]
            total += nbytes
    file_writer: dict[str, int] = {}
    file_digest: dict[str, str] = {}
    reserved = set(shard_of.values()) | {INDEX_FILE}
    full = total
    for rank, o in enumerate(owned):
        for path, (sha, size) in sorted(o.files.items()):
            if path in reserved:
                problems.append(f"extra file {path} (rank {rank}) clashes with a file the push writes itself")
            elif path not in file_writer:
                file_writer[path], file_digest[path] = rank, sha
                full += size
            elif file_digest[path] != sha:
                problems.append(f"extra file {path} differs between ranks {file_writer[path]} and {rank}")
    if not owner:
        problems.append("no rank owns any tensor")
    if problems:
        raise UsageError("multi-rank push refused: " + "; ".join(problems[:5]) + (" …" if len(problems) > 5 else ""))
    return _Layout(shard_of, weight_map, file_writer, total, full)


# --- step 2: the root's decision -----------------------------------------------------------------
@dataclass
class _Decision:
    store_id: str
    head: Head | None
    version: int
    kind: str


def _decide(repo: Repository, version: int | None, full: bool, every: int | None, budget: float | None,
            full_bytes: int) -> _Decision:
    head = checked_head(repo)  # a HEAD naming a missing or different manifest is reported as such
    if version is not None and head is not None and version <= head.version:
        raise UsageError(f"version {version} is not newer than the store's newest version {head.version}")
    new_version = check_version(version if version is not None else (head.version + 1 if head else 1))
    parent = repo.manifest(head.version) if head is not None else None
    kind = "full" if parent is None or full or _keyframe_due(parent, full_bytes, every, budget) else "delta"
    return _Decision(repo.store_id, head, new_version, kind)


# --- step 3: this rank's files -------------------------------------------------------------------
def _write_files(out_dir: str, rank: int, tensors: Mapping[str, Any], extra_files: Mapping[str, bytes],
                 layout: _Layout, is_root: bool) -> None:
    from safetensors.torch import save_file

    if rank in layout.shard_of:
        prepared = {}
        seen: set[int] = set()
        for name, t in tensors.items():
            t = t.detach().to("cpu").contiguous()
            ptr = t.untyped_storage().data_ptr() if t.numel() else 0
            if ptr and ptr in seen:
                t = t.clone()  # tied weights: safetensors refuses shared storage
            seen.add(ptr)
            prepared[name] = t
        save_file(prepared, os.path.join(out_dir, layout.shard_of[rank]), metadata={"format": "pt"})
    for path, data in extra_files.items():
        if layout.file_writer.get(path) == rank:
            full = os.path.join(out_dir, path)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "wb") as fh:
                fh.write(data)
    if is_root:
        index = {"metadata": {"total_size": layout.total_size}, "weight_map": dict(sorted(layout.weight_map.items()))}
        with open(os.path.join(out_dir, INDEX_FILE), "w") as fh:
            json.dump(index, fh, indent=2, sort_keys=True)


def _rank_base(repo: Repository, cache: LocalCheckpoint, head: Head, keys: set[str], *,
               rederive: bool = False) -> tuple[LocalState, bool]:
    """This rank's push cache as a base for `keys`; rebuilt from the store when missing or stale.

    A rank's cache holds only the files of HEAD that its own segments came from, so a rank re-derives
    just those (not the whole checkpoint) after a restart, a new world size or another writer's push.
    """
    man = repo.manifest(head.version)
    needed = sorted({f.path for key, (f, _seg) in man.segments().items() if key in keys})
    state = cache.state()
    if not rederive and state is not None and state.store_id == repo.store_id and state.version == head.version \
            and state.digest == head.digest and all(os.path.isfile(os.path.join(state.path, p)) for p in needed):
        return state, False
    chain = plan_chain(repo, head.version, None)
    only = tuple(f for f in man.files if f.path in set(needed))
    partial = Chain(chain.steps[:-1] + [_with_files(man, only)], None)
    staging = cache.new_staging()
    Builder(repo, partial, ChunkSource(repo, None)).build(staging)  # verifies every digest
    cache.install(staging, store_id=repo.store_id, store_url=repo.url, manifest=man)
    cache.cleanup(keep=1)
    new_state = cache.state()
    assert new_state is not None
    return new_state, True


def _with_files(man: Manifest, files: tuple[FileEntry, ...]) -> Manifest:
    from dataclasses import replace

    return replace(man, files=files)  # only what Builder builds; the digest stays the full version's


@dataclass
class _RankReport:
    files: list[dict[str, Any]]
    stored: int
    chunks_written: int
    chunks_total: int
    elements_total: int
    elements_changed: int
    reused: list[str]
    rederived: bool


# --- the API ---------------------------------------------------------------------------------------
def push_distributed(store: str, tensors: Mapping[str, Any], *, extra_files: Mapping[str, bytes] | None = None,
                     group: Any = None, root: int = 0, version: int | None = None,
                     metadata: Mapping[str, Any] | None = None, storage_options: dict[str, Any] | None = None,
                     cache_dir: str | None = None, level: int = codec.DEFAULT_LEVEL, threads: int | None = None,
                     full: bool = False, keyframe_every: int | None = DEFAULT_KEYFRAME_EVERY,
                     keyframe_budget: float | None = DEFAULT_KEYFRAME_BUDGET, tmp_dir: str | None = None) -> PushResult:
    """Publish the tensors every rank owns as one version. Collective: call on every rank of `group`.

    tensors: the HF-named tensors this rank owns (each name on exactly one rank; a rank may own none).
    extra_files: files such as config.json; any rank may pass them (the same path must have the same
    bytes on every rank that passes it). version, metadata, full and the keyframe policy are taken
    from the root rank. Returns the same PushResult on every rank. Without an initialized
    torch.distributed process group it behaves as a world of one.
    """
    t0 = time.monotonic()
    comm = _Comm(group, root)
    extra = dict(extra_files or {})
    owned = _collective(comm, "checking what each rank owns", lambda: _describe(tensors, extra))
    layout = _layout(owned, comm.world)  # same data on every rank: same result, or the same UsageError

    def decide() -> _Decision:
        try:
            canonical_json(dict(metadata or {}))
        except (TypeError, ValueError) as exc:
            raise UsageError(f"metadata is not JSON: {exc}") from None
        repo = Repository.open(store, storage_options, create=True)
        return _decide(repo, version, full, keyframe_every, keyframe_budget, layout.full_bytes)

    decision: _Decision = _from_root(comm, "reading the store", decide)

    encoder: _Encoder | None = None
    repo_box: list[Repository] = []

    with contextlib.ExitStack() as stack:  # this rank's cache lock and temporary directory

        def encode() -> _RankReport:
            nonlocal encoder
            repo = Repository.open(store, storage_options)
            repo_box.append(repo)
            if repo.store_id != decision.store_id:
                raise UsageError(f"rank {comm.rank} sees another store at {store} than the root rank")
            cache = LocalCheckpoint(os.path.join(cache_dir or default_cache_dir(repo.store_id), f"rank-{comm.rank}", "base"))
            stack.enter_context(cache.lock(wait=False, name="push.lock"))
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="deltafs-rank-", dir=tmp_dir))
            _write_files(tmp, comm.rank, tensors, extra, layout, comm.is_root)
            if not os.listdir(tmp):
                return _RankReport([], 0, 0, 0, 0, 0, [], False)
            files = scan_source(tmp)
            keys = {seg.key for f in files for seg in f.segments}
            rederived = False
            for attempt in range(2):
                base = None
                if decision.kind == "delta":
                    assert decision.head is not None
                    base, fresh = _rank_base(repo, cache, decision.head, keys, rederive=attempt > 0)
                    rederived = rederived or fresh
                enc = encoder = _Encoder(repo, base, level, threads or default_threads(), cache)
                try:
                    entries = enc.encode_files(files, lambda n: None)
                    return _RankReport([e.to_json() for e in entries], enc.stored, enc.chunks_written, enc.chunks_total,
                                       enc.elements_total, enc.elements_changed, sorted(enc.reused), rederived)
                except LocalBaseError:
                    if attempt:
                        raise  # the cache was just rebuilt from the store: something else is wrong
            raise AssertionError("unreachable")

        try:
            reports: list[_RankReport] = _collective(comm, "writing chunks", encode)
            man_bytes, result = _from_root(comm, "committing",
                                           lambda: _commit(repo_box[0], decision, reports, metadata, t0))
        except BaseException:
            if encoder is not None:
                encoder.discard_staging()
            raise
        man = Manifest.from_bytes(man_bytes, where=f"manifest of version {decision.version}")
        if encoder is not None:
            encoder.install_cache(man)
    return PushResult(**{**result, "seconds": time.monotonic() - t0, "base_rederived": any(r.rederived for r in reports)})


def _commit(repo: Repository, decision: _Decision, reports: list[_RankReport], metadata: Mapping[str, Any] | None,
            t0: float) -> tuple[bytes, dict[str, Any]]:
    """Root only: the manifest from every rank's file entries, then the commit."""
    entries = sorted((FileEntry.from_json(f) for r in reports for f in r.files), key=lambda f: f.path)
    parent = repo.manifest(decision.head.version) if decision.head is not None else None
    stored = sum(r.stored for r in reports)
    kind = decision.kind
    full_bytes = sum(f.size for f in entries)
    elements_total = sum(r.elements_total for r in reports)
    elements_changed = sum(r.elements_changed for r in reports)
    meta = dict(metadata or {})
    man, manifest_size = commit_version(
        repo, version=decision.version, kind=kind, parent=parent, head_seen=decision.head, files=entries, metadata=meta,
        stored=stored, chunks_total=sum(r.chunks_total for r in reports),
        chunks_stored=sum(r.chunks_written for r in reports), elements_total=elements_total,
        elements_changed=elements_changed, reused={oid for r in reports for oid in r.reused},
        extra_stats={"ranks": len(reports)})
    result = {
        "version": man.version,
        "kind": kind,
        "parent": man.parent,
        "bytes_written": stored + manifest_size,
        "full_bytes": full_bytes,
        "chunks_written": man.stats["chunks_stored"],
        "changed_fraction": (elements_changed / elements_total if elements_total else 0.0) if kind == "delta" else 1.0,
        "seconds": time.monotonic() - t0,
        "store": repo.url,
        "metadata": meta,
    }
    return man.to_bytes(), result


__all__ = ["DistributedPushError", "push_distributed", "shard_name"]
