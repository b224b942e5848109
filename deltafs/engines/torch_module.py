"""Apply a pulled version in place into a live torch.nn.Module, by HF tensor name; the pause scales with the delta.

A switch has two halves. Staging runs while the module keeps serving: each tensor whose manifest digest differs from
what the module holds is read from the new version's file and checked against that digest, then compared with the
same tensor in the version file the module was loaded from (checked against its digest too) to find the positions
that changed; the positions and new values are moved to the tensor's device. Staging also checks, with a checksum
computed on the device, that the module still holds the bytes the engine believes it holds.

The pause is then only: scatter the changed values in place (`index_copy_` on a flat integer view, so NaN payloads and
signed zeros stay bit-exact), copy whole the few tensors where most elements changed or no previous file is known,
and verify. Changed positions are read back on the device and compared with the staged values; whole copies are
checked by the device checksum against the checksum of the verified file bytes. Only a few integers per tensor come
back to the host. If anything fails, the previous version is put back (see TorchModuleEngine.switch).

With spare=True, staging also writes each changed tensor's new bytes into a second buffer on its device and verifies
that buffer whole by checksum; the pause then only points each tensor at its buffer (`tensor.data`), for twice the
memory and data pointers that change at every switch.

Works wherever the tensors live (CUDA, ROCm, XPU, CPU): everything on the device is plain torch ops.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import numpy as np
import torch

from deltafs.buffers import pread_aligned
from deltafs.checksum import NP_INT_OF_SIZE, device_checksums, host_checksum, int_view
from deltafs.engines.base import SwitchError, SwitchResult, Target
from deltafs.engines.versions import read_version_manifest
from deltafs.errors import DeltafsError, EngineError, IntegrityError
from deltafs.format.digests import segment_digest_like
from deltafs.format.dtypes import safetensors_name
from deltafs.format.manifest import FileEntry, Manifest, Segment

log = logging.getLogger("deltafs.engines.torch")

_DIFF_BLOCK = 1 << 24  # elements compared at once: bounds the temporaries of a diff


def tensor_digest(t: torch.Tensor, like: str = "xxh3-tree:", chunk_bytes: int = 4 << 20) -> str:
    """The digest of the tensor's raw bytes, as safetensors stores them, in the scheme of the segment digest `like`.

    Copies the tensor to the host; the engine itself uses device_checksums instead.
    """
    flat = t.detach().contiguous().reshape(-1).cpu()
    raw: Any = flat.view(torch.uint8).numpy() if flat.numel() else b""
    return segment_digest_like(like, raw, chunk_bytes)


def module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by HF name; tied weights appear under every name they have."""
    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        out[name] = p
    for name, b in module.named_buffers(remove_duplicate=False):
        if b is not None:
            out[name] = b
    return out


# --- staging and applying -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ApplyReport:
    version: int
    changed: int  # tensors written into the module (sparse + whole)
    unchanged: int  # tensors already bit-equal
    skipped: tuple[str, ...]  # checkpoint tensors the module does not have (strict=False)
    seconds: float  # the apply itself (the pause, without waiting for the lock)
    sparse: int = 0  # tensors updated by scattering their changed elements
    whole: int = 0  # tensors copied whole (most elements changed, or no previous bytes to diff against)
    elements: int = 0  # elements written by the sparse updates
    repaired: tuple[str, ...] = ()  # tensors the module held with other bytes than the engine had applied
    stage_seconds: float = 0.0  # reading, checking and diffing before the pause
    swapped: int = 0  # tensors made live by swapping in their spare (spare=True), prepared sparse or whole as counted


@dataclass(frozen=True)
class _Held:
    """What one module tensor is known to hold, and where those bytes are on disk to diff the next version against."""

    digest: str  # the manifest's segment digest of the bytes
    checksum: int  # host_checksum of the bytes
    path: str  # a verified version file holding the bytes
    offset: int  # where they start in that file


@dataclass
class _SparseGroup:
    """The scattered tensors of one device and element size; values (and indices) in one buffer each."""

    device: torch.device
    names: list[str] = field(default_factory=list)
    flats: list[torch.Tensor] = field(default_factory=list)  # int views of the module tensors
    idx: list[np.ndarray] = field(default_factory=list)
    vals: list[np.ndarray] = field(default_factory=list)
    old: list[np.ndarray] = field(default_factory=list)  # the previous values, to undo a failed apply
    idx_dev: list[torch.Tensor] = field(default_factory=list)
    vals_dev: list[torch.Tensor] = field(default_factory=list)
    vals_all: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    back_all: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # the changed positions, read back
    blocks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)


@dataclass(frozen=True)
class _Plan:
    """One tensor's staging result: copy `new` whole, scatter `diff` (positions, new values, old values), or neither
    (the module, of unknown contents before, turned out to hold the bytes already)."""

    name: str
    held: _Held
    new: np.ndarray | None = None
    diff: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None


@dataclass
class _Whole:
    name: str
    target: torch.Tensor
    source: torch.Tensor  # the verified new bytes, on the host (pinned for an accelerator)
    old: torch.Tensor | None = None  # stage(keep_old=True): a host copy of what the module held, for undo


@dataclass
class _Swap:
    """A tensor whose new bytes were written into its spare and verified there; the pause swaps the two."""

    name: str
    target: torch.Tensor  # the module's tensor object (kept: only what it points at changes)
    spare: torch.Tensor  # holds the new version, verified
    old: torch.Tensor | None = None  # what target pointed at before the swap, once swapped
    sparse: bool = False  # prepared by copying the live tensor and scattering the delta, else by a whole copy
    elements: int = 0


@dataclass
class StagedVersion:
    """A version read, checked and diffed against what the module holds; commit() makes it live (once, and only if
    nothing was committed since it was staged)."""

    version: int
    groups: list[_SparseGroup]
    whole: list[_Whole]
    held: dict[str, _Held]  # what each written tensor holds after a successful commit
    unchanged: int
    skipped: tuple[str, ...]
    repaired: tuple[str, ...]
    seconds: float
    names: tuple[str, ...]  # every tensor of the version the module has
    generation: int  # the applier's commit count when staged: a diff is only valid against that state
    swaps: list[_Swap] = field(default_factory=list)
    staging: int = 0  # the applier's stage count: spares hold the bytes of the latest staging only
    committed: bool = False
    prior: dict[str, _Held] = field(default_factory=dict)  # what commit() forgot of the tensors it writes
    restored: bool = False  # undo() put back every byte the commit wrote (the module holds what it held before)

    @property
    def touched(self) -> list[str]:
        return [n for g in self.groups for n in g.names] + [w.name for w in self.whole] + [s.name for s in self.swaps]


_F = TypeVar("_F", bound=Callable[..., Any])


def _in_module_mode(method: _F) -> _F:
    """Run an applier method in the module's own inference mode, whatever the caller's: a switch made inside
    `torch.inference_mode()` (the usual serving loop) would otherwise make the engine's buffers inference tensors,
    which its scatter threads (outside that thread-local mode) cannot write, and would swap inference tensors
    into the module as its spares (no backward through them, no later in-place update outside the mode)."""
    @functools.wraps(method)
    def run(self: ModuleApplier, *args: Any, **kwargs: Any) -> Any:
        with torch.inference_mode(self.inference):
            return method(self, *args, **kwargs)
    return run  # type: ignore[return-value]


def _spare_serial(method: _F) -> _F:
    """In spare mode, one stage() or commit() at a time: stagings write the same spare buffers, and a commit swaps
    them in. Two switches from two threads interleaved so that one reported version 2 while the module held 3."""
    @functools.wraps(method)
    def run(self: ModuleApplier, *args: Any, **kwargs: Any) -> Any:
        if not self.spare:
            return method(self, *args, **kwargs)
        with self._spare_lock:
            return method(self, *args, **kwargs)
    return run  # type: ignore[return-value]


class ModuleApplier:
    """Keeps what each module tensor holds (digest, checksum, source file) so the next apply scatters only the delta.

    `whole_above`: a tensor with more than this fraction of its elements changed is copied whole instead.
    `check_module`: before each apply, checksum every module tensor on its device against what was applied last, and
    repair any that differ by a whole copy (costs reading the module once, outside the pause).
    `threads`: staging reads, hashes and diffs this many tensors at once (default: the CPU count, at most 8).
    `spare`: keep a second buffer per tensor on its device, write and verify the new version there while the module
    serves, and make the pause a swap of what each tensor points at (`tensor.data`). Costs the module's memory once
    more, and tensors' data pointers change at every switch (not for CUDA graphs or code that caches data_ptr()).
    Tensors that do not own their whole storage (views into a shared buffer, tied through different objects,
    non-contiguous) are still updated in place.
    """

    def __init__(self, module: torch.nn.Module, *, strict: bool = True, whole_above: float = 0.5,
                 check_module: bool = True, threads: int | None = None, spare: bool = False) -> None:
        self.module = module
        self.spare = spare
        self._spares: dict[str, torch.Tensor] = {}  # spare=True: the second buffer of each swapped tensor, by name
        self._stagings = 0  # stage() calls so far (see StagedVersion.staging)
        self._spare_lock = threading.RLock()  # spare=True: see _spare_serial
        self.threads = threads or min(8, os.cpu_count() or 1)
        self.strict = strict
        self.whole_above = whole_above
        self.check_module = check_module
        self._held: dict[str, _Held] = {}
        self._chunk_bytes = 4 << 20  # set from each staged manifest
        self._expected: set[str] = set()  # the tensors of the version applied last
        self._generation = 0  # commits so far (see StagedVersion.generation)
        self._pool: ThreadPoolExecutor | None = None  # scatter threads, started at the first CPU pause that uses them
        first = next(iter(module_tensors(module).values()), None)
        # Whether the module's tensors are inference tensors (it was built under torch.inference_mode): the
        # applier's work then runs in that mode, else outside it, so what it writes and swaps in is of their kind.
        self.inference = bool(first is not None and first.is_inference())

    @_in_module_mode
    def apply(self, version_dir: str, manifest: Manifest | None = None) -> ApplyReport:
        """Stage and commit in one go (no lock): make the module hold the version, verified."""
        staged = self.stage(version_dir, manifest)
        try:
            return self.commit(staged)
        except BaseException:
            self.undo(staged)
            raise

    @_in_module_mode
    def verify(self) -> list[str]:
        """Tensors of the version applied last that the module does not hold (by device checksum), or holds unknown bytes.

        An empty list means the module holds that version bit for bit (up to the checksum's collisions).
        """
        live = module_tensors(self.module)
        names = sorted(n for n in self._expected if n in self._held and n in live)
        sums = device_checksums([live[n] for n in names])
        bad = [n for n, s in zip(names, sums, strict=True) if s != self._held[n].checksum]
        return sorted(bad + [n for n in self._expected if n not in self._held or n not in live])

    @_spare_serial
    @_in_module_mode
    def stage(self, version_dir: str, manifest: Manifest | None = None, *, keep_old: bool = False) -> StagedVersion:
        """Everything before the pause: read and check the new bytes, diff them, move the delta to the devices.

        keep_old: also keep a host copy of each tensor that will be copied whole, so that undo() can put it back
        without the previous version's files (the engine asks for it when those files are gone)."""
        t0 = time.monotonic()
        man = manifest or read_version_manifest(version_dir)
        self._chunk_bytes = man.chunk_bytes  # a store's chunk size never changes; v2 digests depend on it
        live = module_tensors(self.module)
        todo: list[tuple[FileEntry, Segment, torch.Tensor]] = []
        skipped: list[str] = []
        for f in man.files:
            if f.format != "safetensors":
                continue
            for seg in f.segments:
                name = seg.tensor_name
                if name is None:
                    continue
                target = live.get(name)
                if target is None:
                    skipped.append(name)
                    continue
                _check_compatible(name, target, seg)
                todo.append((f, seg, target))
        if skipped and self.strict:
            raise EngineError(f"the module has no tensor(s) {', '.join(sorted(skipped)[:5])} of version {man.version}")
        if not todo and live:
            # Nothing to apply and nothing to check: the module would keep its weights under the new version's
            # name (an empty or wrong-rank state dict pushed by mistake).
            raise EngineError(f"version {man.version} holds none of the module's tensors")
        _check_tied(todo, man.version)
        _check_overlaps(todo)
        known, module_sums = self._module_matches(todo)
        repaired = tuple(sorted(n for n, ok in known.items() if ok is False))
        for name in repaired:
            log.warning("module tensor %s does not hold the bytes applied last; copying it whole", name)
        files = {f.path: _VersionFile(version_dir, f, man.chunk_bytes) for f in man.files if f.format == "safetensors"}

        def plan(item: tuple[FileEntry, Segment, torch.Tensor]) -> _Plan | None:
            return self._plan(files[item[0].path], item[1], item[2], known, module_sums)

        with ThreadPoolExecutor(self.threads) as pool:  # reading, hashing and diffing release the GIL
            plans = list(pool.map(plan, todo))
        groups: dict[tuple[torch.device, int], _SparseGroup] = {}
        whole: list[_Whole] = []
        held: dict[str, _Held] = {}
        unchanged = 0
        self._stagings += 1
        staging = self._stagings  # this call's number (read again at the end, it was a later staging's)
        swaps: list[_Swap] = []
        swappable = _swappable([t for _, _, t in todo], list(live.values())) if self.spare else set()
        swapped_objects: set[int] = set()
        for (_, seg, target), p in zip(todo, plans, strict=True):
            if p is None:
                unchanged += 1
            elif id(target) in swapped_objects and (p.new is not None or p.diff is not None):
                held[p.name] = p.held  # a second name of a tensor swapped already (tied: equal bytes)
            elif id(target) in swappable and (p.new is not None or p.diff is not None):
                swapped_objects.add(id(target))
                held[p.name] = p.held
                swaps.append(self._prepare_spare(p, target))
            elif p.new is not None:
                held[p.name] = p.held
                old = target.detach().to("cpu", copy=True) if keep_old else None
                whole.append(_Whole(p.name, target, _host_source(p.new, target), old))
            elif p.diff is None:  # unknown before, and the module turned out to hold it
                self._held[p.name] = p.held
                unchanged += 1
            else:
                held[p.name] = p.held
                g = groups.setdefault((target.device, seg.itemsize), _SparseGroup(target.device))
                g.names.append(p.name)
                g.flats.append(int_view(target))
                g.idx.append(p.diff[0])
                g.vals.append(p.diff[1])
                g.old.append(p.diff[2])
        if swaps:  # the spares are verified whole, before the pause, against the checksums of the verified bytes
            sums = device_checksums([w.spare for w in swaps])
            bad = [w.name for w, got in zip(swaps, sums, strict=True) if got != held[w.name].checksum]
            if bad:
                raise IntegrityError(f"spare buffer(s) of {', '.join(sorted(bad)[:5])} do not hold version "
                                     f"{man.version} after staging")
        for g in groups.values():
            _to_device(g)
        return StagedVersion(man.version, list(groups.values()), whole, held, unchanged, tuple(sorted(skipped)),
                             repaired, time.monotonic() - t0, tuple(seg.tensor_name or "" for _, seg, _ in todo),
                             self._generation, swaps=swaps, staging=staging)

    def _prepare_spare(self, p: _Plan, target: torch.Tensor) -> _Swap:
        """Write the new bytes of one tensor into its spare: the live bytes plus the delta, or the new bytes whole."""
        buf = self._spares.get(p.name)
        if buf is None or buf.shape != target.shape or buf.dtype != target.dtype or buf.device != target.device:
            buf = self._spares[p.name] = torch.empty_like(target, memory_format=torch.contiguous_format)
        with torch.no_grad():
            if p.new is not None:
                buf.copy_(_host_source(p.new, target))
                return _Swap(p.name, target, buf)
            assert p.diff is not None
            idx = torch.from_numpy(p.diff[0]).to(buf.device)
            vals = torch.from_numpy(p.diff[1]).to(buf.device)
            buf.copy_(target)  # the live bytes (checked at the start of staging; the spare's checksum proves the copy)
            int_view(buf).index_copy_(0, idx, vals)
        return _Swap(p.name, target, buf, sparse=True, elements=int(p.diff[0].size))

    @_spare_serial
    @_in_module_mode
    def commit(self, staged: StagedVersion) -> ApplyReport:
        """The pause: scatter, copy, verify on the device. Raises IntegrityError if the module does not hold the version."""
        t0 = time.monotonic()
        if staged.generation != self._generation or staged.committed:
            raise EngineError(f"version {staged.version} was staged against what the module held before another "
                              "apply; stage it again")
        if staged.swaps and staged.staging != self._stagings:
            raise EngineError(f"version {staged.version} was staged into the spare buffers before another staging "
                              "overwrote them; stage it again")
        self._generation += 1
        for name in staged.touched:
            held = self._held.pop(name, None)  # unknown until verified below
            if held is not None:
                staged.prior[name] = held
        staged.committed = True
        bad: list[str] = []
        with torch.no_grad():
            for sw in staged.swaps:  # a pointer swap per tensor: the spare was verified whole while staging, and
                sw.old = sw.target.data  # nothing but this applier can reach it
                sw.target.data = sw.spare
            self._scatter([b for g in staged.groups for b in g.blocks])
            for w in staged.whole:
                w.target.copy_(w.source, non_blocking=True)
            for g in staged.groups:
                if not torch.equal(g.back_all, g.vals_all):
                    bad += [n for n, flat, idx, vals in zip(g.names, g.flats, g.idx_dev, g.vals_dev, strict=True)
                            if not torch.equal(flat.index_select(0, idx), vals)]
            sums = device_checksums([w.target for w in staged.whole])
        bad += [w.name for w, s in zip(staged.whole, sums, strict=True) if s != staged.held[w.name].checksum]
        if bad:
            raise IntegrityError(f"module tensor(s) {', '.join(sorted(bad)[:5])} do not hold version {staged.version} "
                                 "after the apply")
        self._held.update(staged.held)
        self._expected = set(staged.names)
        for sw in staged.swaps:
            assert sw.old is not None
            self._spares[sw.name] = sw.old  # the previous bytes: the buffer the next version is written into
        elements = sum(int(i.size) for g in staged.groups for i in g.idx) + sum(sw.elements for sw in staged.swaps)
        sparse = sum(len(g.names) for g in staged.groups) + sum(sw.sparse for sw in staged.swaps)
        whole = len(staged.whole) + sum(not sw.sparse for sw in staged.swaps)
        return ApplyReport(staged.version, sparse + whole, staged.unchanged, staged.skipped,
                           time.monotonic() - t0, sparse=sparse, whole=whole, elements=elements,
                           repaired=staged.repaired, stage_seconds=staged.seconds, swapped=len(staged.swaps))

    def _scatter(self, blocks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """Write each block's values and read them back. On the CPU, torch runs one scatter on one core while its
        copy_ uses them all: spread the blocks over torch's intra-op thread count (the ops release the GIL)."""
        workers = torch.get_num_threads()
        cpu = [b for b in blocks if b[0].device.type == "cpu"]
        if workers > 1 and len(cpu) >= 2 * workers:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(workers, thread_name_prefix="deltafs-scatter")
            step = -(-len(cpu) // workers)
            scatter = functools.partial(_scatter_blocks, inference=torch.is_inference_mode_enabled())
            list(self._pool.map(scatter, [cpu[i:i + step] for i in range(0, len(cpu), step)]))
            blocks = [b for b in blocks if b[0].device.type != "cpu"]
        _scatter_blocks(blocks)

    @_in_module_mode
    def undo(self, staged: StagedVersion) -> None:
        """After a failed commit: put the previous values back where they were scattered (and where whole copies were
        made, if their old bytes were kept: stage(keep_old=True)); other whole copies stay unknown."""
        if not staged.committed:
            return
        with torch.no_grad():
            for sw in staged.swaps:
                if sw.old is not None:  # swapped: point the tensor back at its previous bytes
                    sw.target.data = sw.old
                    sw.old = None
            for g in staged.groups:
                for flat, idx, old in zip(g.flats, g.idx_dev, g.old, strict=True):
                    flat.index_copy_(0, idx, torch.from_numpy(old).to(g.device))
            for w in staged.whole:  # only where the pause wrote: the copy that failed may be into a tensor that
                # cannot be written at all (an expanded view)
                if w.old is not None and not torch.equal(int_view(w.target).cpu(), int_view(w.old)):
                    w.target.copy_(w.old)
        if all(w.old is not None for w in staged.whole):
            # Every byte written is back: what was known of those tensors before holds again (verify() checks it).
            self._held.update(staged.prior)
            staged.restored = True

    # -- helpers of stage() --

    def _module_matches(self, todo: list[tuple[FileEntry, Segment, torch.Tensor]]
                        ) -> tuple[dict[str, bool | None], dict[str, int]]:
        """Per tensor: True if the module holds what was applied last, False if not, None if nothing is known.

        Also the device checksums computed: of every tensor with check_module, else of the unknown ones only.
        """
        names = [seg.tensor_name or "" for _, seg, _ in todo]
        known: dict[str, bool | None] = {n: (True if n in self._held else None) for n in names}
        wanted = [(n, t) for n, (_, _, t) in zip(names, todo, strict=True) if self.check_module or known[n] is None]
        sums = dict(zip([n for n, _ in wanted], device_checksums([t for _, t in wanted]), strict=True))
        for n, s in sums.items():
            if known[n] is not None:
                known[n] = s == self._held[n].checksum
        return known, sums

    def _plan(self, vf: _VersionFile, seg: Segment, target: torch.Tensor, known: dict[str, bool | None],
              module_sums: dict[str, int]) -> _Plan | None:
        """What one tensor needs (runs on a staging thread): None if the module already holds it."""
        name = seg.tensor_name or ""
        state = known[name]
        if state is True and self._held[name].digest == seg.digest:
            return None
        new = vf.read_verified(seg, name)
        info = _Held(seg.digest, host_checksum(new, seg.itemsize), vf.path, seg.offset)
        if state is None:  # first apply, or after a failure: compare what the module holds by checksum
            return _Plan(name, info) if info.checksum == module_sums[name] else _Plan(name, info, new=new)
        old = self._read_base(self._held[name], seg, name) if state and target.is_contiguous() else None
        diff = _diff(old, new, seg.itemsize, self.whole_above) if old is not None else None
        return _Plan(name, info, new=new) if diff is None else _Plan(name, info, diff=diff)

    def _read_base(self, have: _Held, seg: Segment, name: str) -> np.ndarray | None:
        """The bytes the module holds, from the file they were applied from, if it still has them."""
        try:
            fd = os.open(have.path, os.O_RDONLY)
        except OSError:
            return None
        try:
            data = _read_at(fd, have.offset, seg.size)
        except OSError:
            data = None
        finally:
            os.close(fd)
        if data is None or segment_digest_like(have.digest, data.data, self._chunk_bytes) != have.digest:
            log.info("previous bytes of %s are gone from %s; copying it whole", name, have.path)
            return None
        return data


class _VersionFile:
    """One safetensors file of the version being staged, checked against the manifest's size before any read."""

    def __init__(self, version_dir: str, entry: FileEntry, chunk_bytes: int) -> None:
        self.path = os.path.join(version_dir, entry.path)
        self.chunk_bytes = chunk_bytes
        with open(self.path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
        if size != entry.size:
            raise IntegrityError(f"{self.path} changed since it was pulled", expected=f"{entry.size} bytes",
                                 actual=f"{size} bytes")

    def read_verified(self, seg: Segment, name: str) -> np.ndarray:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            data = _read_at(fd, seg.offset, seg.size)
        finally:
            os.close(fd)
        got = segment_digest_like(seg.digest, data.data, self.chunk_bytes) if data is not None else "a short read"
        if data is None or got != seg.digest:
            raise IntegrityError(f"tensor {name} in {self.path} changed since it was pulled", expected=seg.digest,
                                 actual=got)
        return data


def _read_at(fd: int, offset: int, size: int) -> np.ndarray | None:
    """size bytes at offset into a fresh buffer we own (never a mapping: a file cut short cannot crash us)."""
    buf = pread_aligned(fd, size, offset)  # page-aligned: the kernel's copy into it is up to 4x faster
    return buf if buf.size == size else None


def _scatter_blocks(blocks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]], *,
                    inference: bool = False) -> None:
    """inference: the caller's inference mode (thread-local: a pool thread must enter it itself)."""
    with torch.inference_mode(inference), torch.no_grad():
        for flat, idx, vals, back in blocks:  # each block is read back while its cache lines are hot
            flat.scatter_(0, idx, vals)
            torch.index_select(flat, 0, idx, out=back)


def _diff(old: np.ndarray, new: np.ndarray, itemsize: int, whole_above: float
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Changed element positions, new values and old values; None when more than whole_above of them changed."""
    dt = NP_INT_OF_SIZE[itemsize]
    a, b = old.view(dt), new.view(dt)
    limit = whole_above * a.size
    parts: list[np.ndarray] = []
    count = 0
    for start in range(0, a.size, _DIFF_BLOCK):  # vectorized per block; blocks bound the boolean temporary
        stop = min(start + _DIFF_BLOCK, a.size)
        pos = np.flatnonzero(a[start:stop] != b[start:stop])
        if start:
            pos += start
        parts.append(pos)
        count += pos.size
        if count > limit:
            return None
    idx = np.concatenate(parts) if len(parts) != 1 else parts[0]
    return idx.astype(np.int64, copy=False), b[idx], a[idx]


_CPU_SPAN = 1 << 18  # on the CPU, scatter and read back per 256Ki-element span, so the read-back hits the cache


def _to_device(g: _SparseGroup) -> None:
    """One host-to-device transfer of the group's indices and one of its values; per-tensor and per-block views."""
    sizes = [int(i.size) for i in g.idx]
    idx_all = torch.from_numpy(np.concatenate(g.idx) if g.idx else np.empty(0, np.int64))
    vals_all = torch.from_numpy(np.concatenate(g.vals))
    if g.device.type != "cpu":
        idx_all, vals_all = idx_all.to(g.device), vals_all.to(g.device)
    back_all = torch.empty_like(vals_all)
    g.idx_dev = list(torch.split(idx_all, sizes))
    g.vals_dev = list(torch.split(vals_all, sizes))
    g.vals_all, g.back_all = vals_all, back_all
    g.blocks = []
    start = 0
    for flat, idx in zip(g.flats, g.idx, strict=True):
        cuts = [0, int(idx.size)]
        if g.device.type == "cpu" and flat.numel() > _CPU_SPAN:  # accelerators: one launch per tensor is cheaper
            cuts[1:1] = np.searchsorted(idx, np.arange(_CPU_SPAN, flat.numel(), _CPU_SPAN)).tolist()
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            if b > a:
                g.blocks.append((flat, idx_all[start + a:start + b], vals_all[start + a:start + b],
                                 back_all[start + a:start + b]))
        start += int(idx.size)


def _host_source(data: np.ndarray, target: torch.Tensor) -> torch.Tensor:
    """The verified bytes as a host tensor shaped like target; pinned when target lives on an accelerator."""
    src = torch.from_numpy(data).view(target.dtype).reshape(target.shape)
    if target.device.type != "cpu":
        try:
            src = src.pin_memory()
        except RuntimeError:  # no pinned memory on this backend: a pageable copy still works
            pass
    return src


def _swappable(tensors: list[torch.Tensor], module: list[torch.Tensor]) -> set[int]:
    """ids of the tensors a swap can update: contiguous, alone in their whole storage, no other tensor object of the
    module on it. module: every parameter and buffer, the checkpoint's or not. A tensor the checkpoint does not name
    but the module holds over the same memory (lm_head.weight = Parameter(embed.weight), as HF ties weights; a buffer
    that is a view of a parameter) kept the old buffer when only the named one was swapped: stale weights served,
    and later overwritten as the next spare."""
    objects: dict[tuple[torch.device, int], set[int]] = {}
    for t in [*tensors, *module]:
        if t.numel():
            objects.setdefault((t.device, t.untyped_storage().data_ptr()), set()).add(id(t))
    return {id(t) for t in tensors
            if t.numel() and t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size()
            and len(objects[(t.device, t.untyped_storage().data_ptr())]) == 1}


def _check_tied(todo: list[tuple[FileEntry, Segment, torch.Tensor]], version: int) -> None:
    """Names that share memory in the module (tied weights) must have equal bytes in the checkpoint."""
    seen: dict[tuple[torch.device, int], Segment] = {}
    for _, seg, t in todo:
        if t.numel() == 0:
            continue
        first = seen.setdefault((t.device, t.data_ptr()), seg)
        if first.digest != seg.digest:
            raise EngineError(f"tensors {first.tensor_name} and {seg.tensor_name} are one tensor in the module "
                              f"(tied) but differ in version {version}")


# Views whose byte spans intersect are compared element by element up to this many elements in all; larger groups
# are refused as soon as their spans intersect (a layout no inference module we know uses).
_OVERLAP_EXACT_UP_TO = 1 << 23


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, one past the last byte] that tensor t's elements occupy (strides are never negative)."""
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True)) + 1
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _element_bytes(t: torch.Tensor) -> np.ndarray:
    """The first byte of every element of t (absolute addresses, sorted, each once: an expanded tensor repeats)."""
    offsets = np.zeros(1, np.int64)
    for size, stride in zip(t.shape, t.stride(), strict=True):
        offsets = (offsets[:, None] + np.arange(size, dtype=np.int64)[None, :] * stride).reshape(-1)
    return np.unique(offsets * t.element_size() + t.data_ptr())


def _layout_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Tensors with equal keys hold the same bytes in the same order: one tied tensor (another object, or a view of
    another shape over the same contiguous bytes), which _check_tied compares by digest."""
    start, end = _byte_span(t)
    if t.is_contiguous():
        return (start, end)
    return (start, end, tuple(t.shape), tuple(t.stride()), t.element_size())


def _first_shared_byte(group: list[tuple[str, torch.Tensor]]) -> tuple[str, str] | None:
    """Two names of different layouts in group (byte spans that intersect) that share a byte, or None.

    All element starts are sorted once; an element that starts before the furthest end seen so far overlaps the
    element that reached it, and some such pair belongs to two layouts whenever two layouts share a byte."""
    owners: dict[tuple[Any, ...], int] = {}
    names: list[str] = []
    starts, sizes, owner_of = [], [], []
    for name, t in group:
        key = _layout_key(t)
        if key in owners:
            continue
        owners[key] = len(names)
        names.append(name)
        elements = _element_bytes(t)
        starts.append(elements)
        sizes.append(np.full(elements.size, t.element_size(), np.int64))
        owner_of.append(np.full(elements.size, owners[key], np.int64))
    if len(names) < 2:
        return None
    s, w, o = np.concatenate(starts), np.concatenate(sizes), np.concatenate(owner_of)
    order = np.argsort(s, kind="stable")
    s, e, o = s[order], s[order] + w[order], o[order]
    reach = np.maximum.accumulate(e)
    holder = np.maximum.accumulate(np.where(e == reach, np.arange(e.size), 0))  # whose end is the furthest
    hit = (s[1:] < reach[:-1]) & (o[1:] != o[holder[:-1]])
    if not hit.any():
        return None
    i = int(np.argmax(hit)) + 1
    return names[int(o[holder[i - 1]])], names[int(o[i])]


def _check_overlaps(todo: list[tuple[FileEntry, Segment, torch.Tensor]]) -> None:
    """Names that share only part of their memory (overlapping views, not one tied tensor) cannot both get their
    version's bytes: an in-place write of one changes the other after it was checked. Refused before the pause.
    Interleaved views that share no byte (a matrix's column halves) pass."""
    spans = sorted(((str(t.device), *_byte_span(t)), str(seg.tensor_name or seg.key), t) for _, seg, t in todo
                   if t.numel())
    group: list[tuple[str, torch.Tensor]] = []
    device, reach = "", 0
    for (dev, start, end), name, t in [*spans, (("", 0, 0), "", None)]:
        if group and (t is None or dev != device or start >= reach):
            if len(group) > 1:
                total = sum(int(g.numel()) for _, g in group)
                pair = ((group[0][0], group[1][0]) if total > _OVERLAP_EXACT_UP_TO and
                        len({_layout_key(g) for _, g in group}) > 1 else _first_shared_byte(group))
                if pair is not None:
                    raise EngineError(f"tensors {pair[0]} and {pair[1]} share part of their memory in the module "
                                      "(overlapping views, not one tied tensor): applying a version in place cannot "
                                      "give both their bytes; make them one tied parameter, or separate tensors")
            group = []
        if t is None:
            break
        if not group:
            device, reach = dev, end
        reach = max(reach, end)
        group.append((name, t))


def _check_compatible(name: str, target: torch.Tensor, seg: Segment) -> None:
    if target.is_meta:  # no storage to write (and every meta tensor would look tied to every other)
        raise EngineError(f"tensor {name} is on the meta device, which holds no bytes: materialize the module "
                          "first (module.to_empty(device=...)), then apply")
    want_dtype = str(target.dtype).removeprefix("torch.")
    if tuple(target.shape) != tuple(seg.shape or ()):
        raise EngineError(f"tensor {name}: module shape {tuple(target.shape)} != checkpoint shape {seg.shape}")
    if safetensors_name(want_dtype) != seg.dtype:
        raise EngineError(f"tensor {name}: module dtype {want_dtype} != checkpoint dtype {seg.dtype}; "
                          "in-place apply is bit-exact and never converts")



class TorchModuleEngine:
    """An in-process engine: a torch.nn.Module updated in place, under an optional lock.

    The lock is the "pause": hold it in your inference loop around each forward pass. A switch stages the version
    (reads, checks and diffs it) while you keep running, then waits for the current step and blocks the next one
    only while the changed elements are scattered and verified on the device.
    """

    kind = "torch"

    def __init__(self, module: torch.nn.Module, *, lock: threading.Lock | threading.RLock | None = None,
                 strict: bool = True, whole_above: float = 0.5, check_module: bool = True,
                 threads: int | None = None, spare: bool = False) -> None:
        self.applier = ModuleApplier(module, strict=strict, whole_above=whole_above, check_module=check_module,
                                     threads=threads, spare=spare)
        self.lock: AbstractContextManager[Any] = lock if lock is not None else nullcontext()
        self._version: str | None = None
        self.last_report: ApplyReport | None = None

    @property
    def module(self) -> torch.nn.Module:
        return self.applier.module

    def served_version(self) -> str | None:
        return self._version

    def busy_requests(self) -> int | None:
        return None

    def resume(self) -> None:
        return None

    def switch(self, target: Target, previous: Target | None) -> SwitchResult:
        try:  # outside the pause: parse, read, check and diff; the module is not touched yet
            # Without the previous version's files a failed pause could not put back the tensors it copies whole
            # (they are re-read from those files): keep their old bytes then.
            gone = previous is not None and not os.path.isdir(previous.path)
            staged = self.applier.stage(target.path, read_version_manifest(target.path), keep_old=gone)
        except Exception as exc:  # the module was not touched
            if previous is None:
                rolled_back = False
            elif self._version == previous.version:
                rolled_back = True  # still on previous
            else:
                rolled_back = self._put_back(previous)
            raise SwitchError(f"in-place apply of version {target.version} failed: {exc}",
                              rolled_back=rolled_back, previous=previous) from exc
        started = time.monotonic()
        with self.lock:
            locked = time.monotonic()
            try:
                report = self.applier.commit(staged)
            except BaseException as exc:  # KeyboardInterrupt too: never keep a half-applied module
                rolled_back = self._rollback(staged, previous)
                if not isinstance(exc, Exception):
                    raise
                raise SwitchError(f"in-place apply of version {target.version} failed: {exc}",
                                  rolled_back=rolled_back, previous=previous) from exc
            self._version = target.version
        pause = time.monotonic() - started
        self.last_report = report
        log.debug("version %s: staged in %.3fs, pause %.4fs (%d scattered, %d whole, %d unchanged)", target.version,
                  report.stage_seconds, time.monotonic() - locked, report.sparse, report.whole, report.unchanged)
        return SwitchResult(version=target.version, pause_seconds=pause, load_seconds=report.seconds,
                            tensors_changed=report.changed)

    def _put_back(self, previous: Target) -> bool:
        """Apply previous after a failed staging, when the module was not on it (a fresh engine, an earlier failed
        rollback): staged while the module serves, committed under the lock (it was applied without the lock)."""
        try:
            staged = self.applier.stage(previous.path, read_version_manifest(previous.path))
            with self.lock:
                try:
                    self.applier.commit(staged)
                except BaseException:
                    self.applier.undo(staged)
                    raise
        except (DeltafsError, OSError, RuntimeError, ValueError) as exc:
            log.critical("rollback of the module to version %s failed: %s", previous.version, exc)
            self._version = None
            return False
        self._version = previous.version
        return True

    def _rollback(self, staged: StagedVersion, previous: Target | None) -> bool:
        """Put the module back on previous after a failed pause: undo the scatter, then re-apply previous where
        checksums disagree."""
        try:
            self.applier.undo(staged)
            if previous is None:
                self._version = None  # partly applied: what the module holds is no known version
                return False
            if staged.restored and not os.path.isdir(previous.path):
                # The undo put back every byte (the old bytes were kept because previous's files are gone);
                # the device checksums confirm it.
                if self.applier.verify():
                    raise IntegrityError(f"the module does not hold version {previous.version} after the undo")
            else:
                self.applier.apply(previous.path)
        except (DeltafsError, OSError, RuntimeError, ValueError) as exc:
            log.critical("rollback of the module to version %s failed: %s",
                         previous.version if previous else "?", exc)
            self._version = None
            return False
        self._version = previous.version
        return True
