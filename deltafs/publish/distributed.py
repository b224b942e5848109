"""Multi-rank push: every rank encodes and writes the chunks of the tensors it owns; one rank commits.

    import torch.distributed as dist
    from deltafs.publish.distributed import push_distributed

    mine = {name: t for name, t in hf_state.items() if owner(name) == dist.get_rank()}
    res = push_distributed("s3://bucket/run-7", mine, extra_files={"config.json": cfg})  # on every rank

Each rank describes what it owns (names, dtypes, shapes, extra file digests); all ranks check the
union: a tensor owned by two ranks, a file given with different bytes -> UsageError everywhere,
before anything is written. Each rank's tensors become its own shard `model-<r+1>-of-<R>.safetensors`
(plus the extra files it is the first to name; the root also has model.safetensors.index.json),
streamed into chunks without a file on disk. Then the ranks run the one push pipeline
(deltafs.publish.pipeline: plan, encode, commit, fold) over `group`; every rank gets the same outcome.

DTensor values (an FSDP2 or tensor-parallel state dict, the same names on every rank) are gathered
with full_tensor() one by one, in name order, on every rank; each is kept only by the rank that
writes it (round robin by size), so no rank holds more than its share plus one tensor.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, Unpack

from deltafs.errors import SourceError, UsageError, integer
from deltafs.format.manifest import path_clash
from deltafs.publish.device_diff import DeviceBaseline, baseline_push, check_baseline
from deltafs.publish.hf import INDEX_FILE, check_tensor, collect_tensors, index_bytes, make_shard, shard_file_name
from deltafs.publish.options import PushKeywords, PushOptions, PushResult
from deltafs.publish.pipeline import DistributedPushError, RankWork, World, collective, run
from deltafs.publish.source import MAX_HEADER_BYTES, Piece, memory_source, safetensors_segments


T = TypeVar("T")


def shard_name(rank: int, world: int) -> str:
    """The deterministic file name of a rank's tensors (HF's sharded-checkpoint convention)."""
    return shard_file_name(rank + 1, world)


# --- communication -------------------------------------------------------------------------------
class _Comm:
    """The pipeline's World over a torch.distributed group, or a world of one without a process group."""

    def __init__(self, group: Any, root: Any) -> None:
        import torch.distributed as dist

        self.dist = dist if dist.is_available() and dist.is_initialized() else None
        self.group = group
        if self.dist is None:
            self.rank, self.world = 0, 1
        else:
            self.rank = dist.get_rank(group)
            if self.rank < 0:
                raise UsageError("push_distributed was called on a rank that is not in the given group")
            self.world = dist.get_world_size(group)
        self.root = root  # checked by check_root(), inside the first collective
        self.root_global = 0

    def check_root(self) -> None:
        """UsageError for a root outside the group; then the root's global rank is known (for broadcasts)."""
        root = integer(self.root)  # numpy's integers too
        if root is None:
            raise UsageError(f"root must be an int (a rank of the group), got {type(self.root).__name__} {self.root!r}")
        self.root = root
        if not 0 <= root < self.world:
            raise UsageError(f"root rank {root!r} is not in a group of {self.world} ranks")
        if self.dist is not None:
            self.root_global = self.dist.get_global_rank(self.group, root) if self.group is not None else root

    @property
    def is_root(self) -> bool:
        return bool(self.rank == self.root)

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


def on_every_rank(what: str, fn: Callable[[], T], *, group: Any = None) -> T:
    """fn() on this rank, inside a collective over `group` (torch.distributed's default group when None): if it raises
    on any rank, it raises on every rank. For a caller's own checks before a push_distributed: a rank that failed on
    its own before the push's first collective would leave the others waiting there, and its next call (the next
    step) would meet them: two steps pushed as one version."""
    comm = _Comm(group, 0)
    box: list[T] = []

    def run() -> bool:
        box.append(fn())
        return True

    collective(comm, what, run, tag="on_every_rank")  # what may name the rank ("loading shard 3"): not the tag
    return box[0]


# --- the call: the same on every rank -----------------------------------------------------------------
@dataclass
class _Call:
    """What a rank's call says about the push it is part of, as sent to the other ranks."""

    root: Any
    version: int | None
    metadata: dict[str, Any]


def _check_same_call(calls: list[_Call]) -> None:
    """UsageError on every rank when the ranks' calls are not one push: another root, or another version number or
    metadata `step` (the root's metadata is the version's, so a rank may leave these out or give other keys, such as
    its own loss; but a rank that gives a version or a step must give the root's: ranks that disagree are pushing
    different steps, say after one of them failed a step on its own)."""
    root = calls[0].root
    problems = [f"rank {r} names root {c.root!r}, rank 0 root {root!r}" for r, c in enumerate(calls) if c.root != root]
    if not problems:
        ref = calls[root]
        for r, c in enumerate(calls):
            if c.version is not None and c.version != ref.version:
                problems.append(f"rank {r} pushes version {c.version}, the root (rank {root}) {ref.version}")
            if STEP_KEY in c.metadata and c.metadata[STEP_KEY] != ref.metadata.get(STEP_KEY):
                problems.append(f"rank {r} gives {STEP_KEY} {_short(c.metadata[STEP_KEY])}, the root (rank {root}) "
                                f"{_short(ref.metadata.get(STEP_KEY))}")
    if problems:
        raise UsageError("multi-rank push refused: the ranks are not making the same push (" + "; ".join(problems[:3])
                         + (" …" if len(problems) > 3 else "") + "); nothing was written")


STEP_KEY = "step"  # the metadata key every rank's call must agree on when it gives it


def _short(metadata: Any) -> str:
    text = json.dumps(metadata, sort_keys=True, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


# --- what every rank owns ------------------------------------------------------------------------
@dataclass
class _Owned:
    tensors: list[tuple[str, str, tuple[int, ...], int]]  # name, safetensors dtype, shape, bytes
    files: dict[str, tuple[str, int]]  # extra file path -> (sha256, size)
    file_tensors: dict[str, list[str]] = field(default_factory=dict)  # extra .safetensors path -> its tensor names


def _describe(tensors: Mapping[str, Any], extra_files: Mapping[str, bytes]) -> _Owned:
    out = [(name, check_tensor(name, t), tuple(t.shape), t.numel() * t.element_size()) for name, t in tensors.items()]
    files = {}
    file_tensors: dict[str, list[str]] = {}
    for path, data in extra_files.items():
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise UsageError(f"extra file {path} must be bytes")
        files[path] = (hashlib.sha256(data).hexdigest(), len(data))
        if isinstance(path, str) and path.endswith(".safetensors"):
            try:  # the header only: the file itself may be large
                segs = safetensors_segments(path, bytes(memoryview(data)[:8 + MAX_HEADER_BYTES]), len(data))
            except SourceError:
                continue  # the rank's own source check says what is wrong, on that rank
            file_tensors[path] = [seg.key[2:] for seg in segs if seg.kind == "tensor"]
    return _Owned(out, files, file_tensors)


@dataclass
class _Layout:
    """Who writes what, computed identically on every rank from all ranks' _Owned."""

    shard_of: dict[int, str]  # rank -> shard file name (ranks without tensors write none)
    weight_map: dict[str, str]  # tensor -> shard file name
    file_writer: dict[str, int]  # extra file path -> the rank that writes it
    total_size: int


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
    for rank, o in enumerate(owned):
        for path, (sha, _size) in sorted(o.files.items()):
            if path in reserved:
                problems.append(f"extra file {path} (rank {rank}) clashes with a file the push writes itself")
            elif path not in file_writer:
                file_writer[path], file_digest[path] = rank, sha
            elif file_digest[path] != sha:
                problems.append(f"extra file {path} differs between ranks {file_writer[path]} and {rank}")
    in_files: dict[str, str] = {}
    for path, rank in sorted(file_writer.items()):
        for name in owned[rank].file_tensors.get(path, ()):
            if name in owner:
                problems.append(f"tensor {name} of extra file {path} (rank {rank}) is also pushed by rank {owner[name][0]}")
            elif name in in_files:
                problems.append(f"tensor {name} is in extra files {in_files[name]} and {path}")
            else:
                in_files[name] = path
    nested = path_clash(set(file_writer) | set(shard_of.values()) | {INDEX_FILE})
    if nested is not None:
        problems.append(f"{nested[0]} would be both a file and the directory of {nested[1]}")
    if not owner:
        problems.append("no rank owns any tensor")
    if problems:
        raise UsageError("multi-rank push refused: " + "; ".join(problems[:5]) + (" …" if len(problems) > 5 else ""))
    return _Layout(shard_of, weight_map, file_writer, total)


def _gather_dtensors(comm: World, tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Replace DTensors by full tensors on the rank that writes each; the others drop them (see the docstring)."""
    names = sorted(n for n, t in tensors.items() if type(t).__name__ == "DTensor")
    if not names:
        return dict(tensors)
    everyone = collective(comm, "listing DTensors", lambda: names)
    if any(other != names for other in everyone):
        raise UsageError("DTensors must have the same names on every rank (a state dict of one FSDP2 model)")
    load = [0] * comm.world
    out = {n: t for n, t in tensors.items() if type(t).__name__ != "DTensor"}
    for name in names:
        t = tensors[name]
        writer = min(range(comm.world), key=lambda r: (load[r], r))
        load[writer] += t.numel() * t.element_size()
        full = t.full_tensor()  # collective: every rank, same order
        if writer == comm.rank:
            out[name] = full.detach()
    return out


# --- the API ---------------------------------------------------------------------------------------
def push_distributed(store: str, tensors: Mapping[str, Any], options: PushOptions | None = None, *,
                     extra_files: Mapping[str, bytes] | None = None, group: Any = None, root: int = 0,
                     device_baseline: DeviceBaseline | None = None, **kw: Unpack[PushKeywords]) -> PushResult:
    """Publish the tensors every rank owns as one version. Collective: call on every rank of `group`.

    tensors: the HF-named tensors this rank owns (each name on exactly one rank; a rank may own none),
    or DTensors with the same names on every rank. extra_files: files such as config.json; any rank
    may pass them (the same path must have the same bytes on every rank that passes it). The options
    (PushOptions, or its fields as keywords) are taken from the root rank for version, metadata,
    full and the keyframe policy; a rank that gives a version or a metadata `step` other than the root's
    refuses the push on every rank (the ranks would be pushing different steps), and so do different roots. Returns the same PushResult on every rank. Without an initialized
    torch.distributed process group it behaves as a world of one. device_baseline: this rank's, as for
    push_tensors (deltafs.publish.device_diff).
    """
    t0 = time.monotonic()
    comm = _Comm(group, root)

    def start() -> _Call:
        # Every check a rank makes on its own runs inside this first collective. A rank that raised before it would
        # leave the others waiting in it, and its next call (the trainer's next step) would meet them there: two
        # steps pushed as one version.
        comm.check_root()
        opts = PushOptions.of(options, **kw)
        if not isinstance(tensors, Mapping):
            raise UsageError(f"tensors must be a mapping of names to tensors, got {type(tensors).__name__}")
        if extra_files is not None and not isinstance(extra_files, Mapping):
            raise UsageError(f"extra_files must be a mapping of paths to bytes, got {type(extra_files).__name__}")
        check_baseline(device_baseline)  # here, inside the collective: on one rank alone the others would wait
        mine.append(opts)  # stays on this rank (storage options, callbacks)
        step = {STEP_KEY: opts.metadata[STEP_KEY]} if STEP_KEY in opts.metadata else {}
        return _Call(comm.root, opts.version, step)

    mine: list[PushOptions] = []
    _check_same_call(collective(comm, "checking the call", start))
    opts = mine[0]
    tensors = _gather_dtensors(comm, tensors)
    extra = dict(extra_files or {})
    owned = collective(comm, "checking what each rank owns", lambda: _describe(tensors, extra))
    layout = _layout(owned, comm.world)  # same data on every rank: same result, or the same UsageError
    with baseline_push(device_baseline) as done:
        made: list[RankWork] = []

        def prepare() -> bool:
            files: dict[str, list[tuple[int, Piece]]] = {}
            if comm.rank in layout.shard_of:
                shard = make_shard(layout.shard_of[comm.rank], collect_tensors(tensors, device_baseline),
                                   {"format": "pt"})
                files[shard.name] = shard.pieces()
            for path, data in extra.items():
                if layout.file_writer.get(path) == comm.rank:
                    files[path] = [(0, memoryview(bytes(data)))]
            if comm.is_root:
                files[INDEX_FILE] = [(0, memoryview(index_bytes(layout.weight_map, layout.total_size)))]
            made.append(RankWork(memory_source(files), cache_name=f"rank-{comm.rank}"))
            return True

        # As a collective: a rank whose shard or files cannot be made (an extra file that is no valid safetensors,
        # say) tells every rank at once; the others waited for it until the process group's timeout.
        collective(comm, "preparing each rank's files", prepare)
        return done(run(comm, store, made[0], opts, t0=t0))


__all__ = ["DistributedPushError", "on_every_rank", "push_distributed", "shard_name"]
