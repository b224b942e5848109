"""Opt-in: find a push's changed elements on the accelerator, so only they cross to the host.

A DeviceBaseline keeps, on each tensor's own device, the bytes of the version the last push published. When the next
push (`push_tensors(..., device_baseline=b)`) reads a range of an accelerator tensor (hf.DeviceBytes), the range is
compared with the baseline there; only the changed positions (int32) and their values are copied to the host, and the
range is rebuilt on the host from the previous version's bytes that the encoder reads from the push cache anyway.

Two checks stand between the baseline and the store:

1. Version identity. The baseline remembers which version it holds (store id, version number and the committed
   manifest's digest: a copy of a store has the same id, and its own version of the same number) and is used only
   by a push whose base is that version. Another writer's push in between, a push cache re-derived from the store,
   another store or a copy of this one, or a push that failed (which leaves the baseline unarmed) all make the push
   copy every range whole, and re-arm the baseline for the version it publishes. A range is diffed at most once per
   push: its read also overwrites the baseline there, so a range read again in the same push (an encode tried
   again after its push cache failed its check, or after a gc removed chunks) is copied whole.
2. A checksum, computed on the device over the live range and on the host over the rebuilt one (deltafs.checksum).
   It catches accidents (a bug, a stray write into the baseline); it is linear, so it is not the guard against a
   baseline that holds another version (1 is). A mismatch copies the range whole and stops diffing for the rest of
   the push.

Every read also copies the live range into the baseline on the device; the push waits for those copies before it
returns, so the caller may change the tensors afterwards. Costs one more copy of the pushed accelerator tensors on
their devices. Host tensors are read in place by a push and never use the baseline. All device work is plain torch
ops (CUDA, ROCm, XPU; CPU tensors in the tests).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

import numpy as np

from deltafs.checksum import NP_INT_OF_SIZE, device_checksums, host_checksum, int_dtype
from deltafs.errors import UsageError
from deltafs.publish.devices import lazy_torch, wait_for_devices

_POSITION_BYTES = 4  # positions cross as int32: ranges of 2**31 elements or more are copied whole
Known = tuple[np.ndarray, np.ndarray]  # (ascending element indices, their values), as codec.encode takes them
VersionId = tuple[str, int, str]  # (store id, version number, manifest digest): one committed version
Writing = tuple[str, int]  # (store id, version number) of the version a push writes: its digest comes at the commit


@dataclass(frozen=True)
class DiffStats:
    """What one push read through the baseline."""

    ranges_diffed: int = 0  # ranges rebuilt from their changed elements
    ranges_copied: int = 0  # ranges copied whole (no base, another base version, too small, too many changes,
    #                         first push, mismatch)
    mismatches: int = 0  # rebuilt ranges whose checksum differed from the device's (then copied whole)
    bytes_read: int = 0  # bytes of the ranges: what copying every range whole moves to the host
    bytes_to_host: int = 0  # what crossed: positions and values of diffed ranges, whole copied ranges


class _Slot:
    """One tensor's previous bytes on its device (flat uint8), and how many bytes this push copied into them."""

    def __init__(self, buf: Any, itemsize: int, diffable: bool) -> None:
        self.buf = buf
        self.itemsize = itemsize
        self.diffable = diffable  # buf holds the baseline's version (not allocated by this push)
        self.captured = 0
        self.spans: list[tuple[int, int]] = []  # this push: the byte ranges already copied into buf

    def overwritten(self, start: int, end: int) -> bool:
        """Whether this push already copied the live bytes into any of buf[start:end] (it no longer holds the
        baseline's version there)."""
        return any(a < end and start < b for a, b in self.spans)


class DeviceBaseline:
    """The previous version of a push's accelerator tensors, kept on their devices (see the module docstring).

    min_range: ranges smaller than this are copied whole (a diff costs a few kernel launches and syncs);
    max_fraction: a range whose changed elements (positions and values) would move more than this fraction of its
    bytes is copied whole. One push at a time may use a baseline.
    """

    def __init__(self, *, min_range: int = 64 << 10, max_fraction: float = 0.5) -> None:
        if min_range < 1 or not 0.0 < max_fraction <= 1.0:
            raise UsageError("DeviceBaseline: min_range must be >= 1 and max_fraction in (0, 1]")
        self.min_range = min_range
        self.max_fraction = max_fraction
        self.last = DiffStats()
        self._slots: dict[str, _Slot] = {}
        self._used: set[str] = set()
        self._lock = threading.Lock()
        self._holds: VersionId | None = None  # the version every slot holds (None: not armed)
        self._diff_from: VersionId | None = None  # this push: the version it may diff against, until a mismatch
        self._writing: set[Writing] = set()  # this push: the version(s) its reads said they write
        self._busy = False
        self._stats = DiffStats()

    @property
    def armed(self) -> bool:
        """Whether the baseline holds a version a next push can diff against (the last push that used it returned)."""
        return self._holds is not None

    @property
    def holds(self) -> VersionId | None:
        """(store id, version, manifest digest) the baseline holds, or None."""
        return self._holds

    def begin(self) -> None:
        """Start a push: slots are handed out by slot(), reads go through read()."""
        with self._lock:
            if self._busy:
                raise UsageError("a DeviceBaseline is used by another push right now")
            self._busy = True
            self._diff_from, self._holds = self._holds, None
            self._used = set()
            self._writing = set()
            self._stats = DiffStats()
            for s in self._slots.values():
                s.captured = 0
                s.spans = []

    def end(self, ok: bool, digest: str | None = None) -> None:
        """Finish a push: wait for the copies into the baseline; armed for the version the push wrote (digest: its
        committed manifest's) only if it succeeded, every byte of every tensor it pushed was captured, and its reads
        named one version."""
        try:
            wait_for_devices({str(s.buf.device) for s in self._slots.values()})
        except BaseException:
            ok = False
            raise
        finally:
            with self._lock:
                for name in set(self._slots) - self._used:
                    del self._slots[name]  # tensors the pushed version no longer has: free their device memory
                complete = all(s.captured >= s.buf.numel() for s in self._slots.values())
                self._holds = None
                if ok and complete and len(self._writing) == 1 and digest is not None:
                    store_id, version = next(iter(self._writing))
                    self._holds = (store_id, version, digest)
                self._diff_from = None
                self._busy = False
                self.last = self._stats

    def slot(self, name: str, flat: Any, itemsize: int) -> _Slot:
        """The slot for tensor `name` whose bytes are `flat` (a flat uint8 view on its device)."""
        with self._lock:
            if not self._busy:
                raise UsageError("DeviceBaseline.slot outside a push")
            if name in self._used:
                raise UsageError(f"tensor {name} appears twice in one push")
            self._used.add(name)
            s = self._slots.get(name)
            if s is None or s.buf.numel() != flat.numel() or s.buf.device != flat.device or s.itemsize != itemsize:
                s = self._slots[name] = _Slot(flat.new_empty(flat.numel()), itemsize, False)
            else:
                s.diffable = self._diff_from is not None
            return s

    def read(self, s: _Slot, src: Any, start: int, out: np.ndarray, base: Any,
             versions: tuple[VersionId | None, Writing] | None) -> tuple[np.ndarray, Known | None]:
        """The host bytes of src (the live range [start, start + len) of the slot's tensor) into out, and the range
        captured into the baseline.

        base: the range's bytes in the push's base version, on the host, or None; versions: (the base version, the
        version being written), or None when the read is not for a push's own encode. Also returns, for a range
        rebuilt from its changes, (element indices, values) that include every element where it differs from
        base (codec.encode's `known`), else None.
        """
        size = int(src.numel())
        prev = s.buf[start:start + size]
        known = None
        if versions is not None:
            with self._lock:
                self._writing.add(versions[1])
                usable = (base is not None and versions[0] is not None and versions[0] == self._diff_from
                          and not s.overwritten(start, start + size))
            if usable:
                known = self._rebuild(s, src, prev, out, base)
        if known is None:
            self._copy_whole(src, out)
        self._capture(prev, src)
        with self._lock:
            s.captured += size
            s.spans.append((start, start + size))
            st = self._stats
            moved = size if known is None else known[0].size * (_POSITION_BYTES + s.itemsize)
            self._stats = replace(st, bytes_read=st.bytes_read + size, bytes_to_host=st.bytes_to_host + moved,
                                  ranges_diffed=st.ranges_diffed + (known is not None),
                                  ranges_copied=st.ranges_copied + (known is None))
        return out, known

    def _rebuild(self, s: _Slot, src: Any, prev: Any, out: np.ndarray, base: Any) -> Known | None:
        """Rebuild the range on the host from its changed elements: (indices, values) of what changed against prev,
        or None to copy the range whole."""
        size = int(src.numel())
        w = s.itemsize
        if (not s.diffable or self._diff_from is None or size < self.min_range or size % w or len(base) != size
                or size // w >= 1 << 31):
            return None
        found = self._device_diff(src, prev, w, size * self.max_fraction)
        if found is None:
            return None
        where, values, expect = found
        np.copyto(out, np.frombuffer(base, np.uint8))
        out.view(NP_INT_OF_SIZE[w])[where] = values
        if host_checksum(out, w) != expect:
            with self._lock:
                self._diff_from = None  # copy the rest of this push whole
                self._stats = replace(self._stats, mismatches=self._stats.mismatches + 1)
            return None
        return where, values

    @staticmethod
    def _device_diff(src: Any, prev: Any, w: int, max_bytes: float) -> tuple[np.ndarray, np.ndarray, int] | None:
        """On the device: where src differs from prev, as host (indices, values), and the checksum of src; None
        when those would move more than max_bytes (or the range cannot be viewed as its elements). Waits for the
        device three times (the count, the transfers, the checksum)."""
        th = lazy_torch()
        try:
            cur, old = src.view(int_dtype(w)), prev.view(int_dtype(w))
        except RuntimeError:  # a range not aligned to its element size: copy it whole
            return None
        with th.no_grad():
            pos = (cur != old).nonzero().view(-1)
            if int(pos.numel()) * (_POSITION_BYTES + w) > max_bytes:
                return None
            values = cur.index_select(0, pos).cpu().numpy().view(NP_INT_OF_SIZE[w])
            where = pos.to(th.int32).cpu().numpy().astype(np.intp)  # numpy indexes with intp ~2x faster
            return where, values, device_checksums([cur])[0]

    @staticmethod
    def _copy_whole(src: Any, out: np.ndarray) -> None:
        lazy_torch().from_numpy(out).copy_(src)  # device to host

    @staticmethod
    def _capture(prev: Any, src: Any) -> None:
        prev.copy_(src)  # device to device (asynchronous on an accelerator: end() waits for it)


def check_baseline(baseline: object) -> None:
    """UsageError unless baseline is None or a DeviceBaseline."""
    if baseline is not None and not isinstance(baseline, DeviceBaseline):
        raise UsageError(f"device_baseline must be a deltafs.DeviceBaseline, not {type(baseline).__name__}")


class _HasDigest(Protocol):
    @property
    def digest(self) -> str | None: ...


R = TypeVar("R", bound=_HasDigest)


class Committed:
    """What a push tells its baseline_push: the digest of the manifest it committed."""

    def __init__(self) -> None:
        self.digest: str | None = None

    def __call__(self, result: R) -> R:
        """Record result's manifest digest (a PushResult) and return result."""
        self.digest = result.digest
        return result


@contextlib.contextmanager
def baseline_push(baseline: DeviceBaseline | None) -> Iterator[Committed]:
    """One push's use of a baseline (or none): begin, then end armed only if the push returned and named its
    committed manifest (`return done(run(...))` with the yielded Committed)."""
    done = Committed()
    if baseline is None:
        yield done
        return
    check_baseline(baseline)
    baseline.begin()
    ok = False
    try:
        yield done
        ok = True
    finally:
        baseline.end(ok, done.digest)


__all__ = ["Committed", "DeviceBaseline", "check_baseline", "DiffStats", "Known", "VersionId", "Writing", "baseline_push"]
