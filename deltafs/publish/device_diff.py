"""Opt-in: find a push's changed elements on the accelerator, so only they cross to the host.

A DeviceBaseline keeps, on each tensor's own device, the bytes of the version the last push published. When the next
push (`push_tensors(..., device_baseline=b)`) reads a range of an accelerator tensor (hf.DeviceBytes), the range is
compared with the baseline there; only the changed positions (int32) and their values are copied to the host, and the
range is rebuilt on the host from the previous version's bytes that the encoder reads from the push cache anyway.

Nothing is trusted: the rebuilt range must have the checksum that the device computes over the live range
(deltafs.checksum). A mismatch (the baseline does not hold the push's base version: another writer published in
between, a push cache rebuilt from an older version, a failed push) copies that range whole and stops diffing for the
rest of the push. Every read also copies the live range into the baseline on the device, so once a push has read
every range and returned, the baseline holds what it published; a push that fails leaves the baseline unarmed, and
the next push copies everything whole and re-arms it.

Costs one more copy of the pushed accelerator tensors on their devices. Host tensors are read in place by a push and
never use the baseline. All device work is plain torch ops (CUDA, ROCm, XPU; CPU tensors in the tests).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from deltafs.checksum import checksum_on_device, host_checksum, int_dtype
from deltafs.errors import UsageError

_MASK = (1 << 64) - 1
_POSITION_BYTES = 4  # a chunk holds fewer than 2**31 elements: positions cross as int32
_NP_INT = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
Known = tuple[np.ndarray, np.ndarray]  # (ascending element indices, their values), as codec.encode takes them


@dataclass(frozen=True)
class DiffStats:
    """What one push read through the baseline."""

    ranges_diffed: int = 0  # ranges rebuilt from their changed elements
    ranges_copied: int = 0  # ranges copied whole (no base, too small, too many changes, first push, mismatch)
    mismatches: int = 0  # rebuilt ranges whose checksum differed from the device's (then copied whole)
    bytes_read: int = 0  # bytes of the ranges: what copying every range whole moves to the host
    bytes_to_host: int = 0  # what crossed: positions and values of diffed ranges, whole copied ranges


class _Slot:
    """One tensor's previous bytes on its device (flat uint8), and how many bytes this push copied into them."""

    def __init__(self, buf: Any, itemsize: int, diffable: bool) -> None:
        self.buf = buf
        self.itemsize = itemsize
        self.diffable = diffable  # buf holds the previous version (not allocated by this push)
        self.captured = 0


class DeviceBaseline:
    """The previous version of a push's accelerator tensors, kept on their devices (see the module docstring).

    min_range: ranges smaller than this are copied whole (a diff costs a few kernel launches and one sync);
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
        self._armed = False  # the slots hold what the last push published
        self._diffing = False  # this push may diff (armed at its start, until a mismatch)
        self._busy = False
        self._stats = DiffStats()

    @property
    def armed(self) -> bool:
        """Whether the next push can diff against the baseline (the last push that used it returned)."""
        return self._armed

    def begin(self) -> None:
        """Start a push: slots are handed out by slot(), reads go through read()."""
        with self._lock:
            if self._busy:
                raise UsageError("a DeviceBaseline is used by another push right now")
            self._busy = True
            self._diffing, self._armed = self._armed, False
            self._used = set()
            self._stats = DiffStats()
            for s in self._slots.values():
                s.captured = 0

    def end(self, ok: bool) -> None:
        """Finish a push: armed only if it succeeded and every byte of every tensor it pushed was captured."""
        with self._lock:
            for name in set(self._slots) - self._used:
                del self._slots[name]  # tensors the pushed version no longer has: free their device memory
            self._armed = ok and all(s.captured >= s.buf.numel() for s in self._slots.values())
            self._diffing = False
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
                s.diffable = self._diffing
            return s

    def read(self, s: _Slot, src: Any, start: int, out: np.ndarray, base: Any) -> tuple[np.ndarray, Known | None]:
        """The host bytes of src (the live range [start, start + len) of the slot's tensor) into out, and the range
        captured into the baseline. base: the previous version's bytes of the range on the host, or None.

        Also returns, for a range rebuilt from its changes, (element indices, values) that include every element
        where it differs from base (codec.encode's `known`), else None.
        """
        size = int(src.numel())
        prev = s.buf[start:start + size]
        known = self._rebuild(s, src, prev, out, base) if base is not None else None
        if known is None:
            self._copy_whole(src, out)
        self._capture(prev, src)
        with self._lock:
            s.captured += size
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
        if not (self._diffing and s.diffable) or size < self.min_range or size % w or len(base) != size:
            return None
        found = self._device_diff(src, prev, w, size * self.max_fraction)
        if found is None:
            return None
        where, values, expect = found
        np.copyto(out, np.frombuffer(base, np.uint8))
        out.view(_NP_INT[w])[where] = values
        if host_checksum(out, w) != expect:
            with self._lock:
                self._diffing = False  # the baseline is not the base: copy the rest of this push whole
                self._stats = replace(self._stats, mismatches=self._stats.mismatches + 1)
            return None
        return where, values

    @staticmethod
    def _device_diff(src: Any, prev: Any, w: int, max_bytes: float) -> tuple[np.ndarray, np.ndarray, int] | None:
        """On the device: where src differs from prev, as host (indices, values), and the checksum of src; None
        when those would move more than max_bytes (or the range cannot be viewed as its elements)."""
        th = _torch()
        try:
            cur, old = src.view(int_dtype(w)), prev.view(int_dtype(w))
        except RuntimeError:  # a range not aligned to its element size: copy it whole
            return None
        with th.no_grad():
            pos = (cur != old).nonzero().view(-1)  # one sync: how many changed
            if int(pos.numel()) * (_POSITION_BYTES + w) > max_bytes:
                return None
            values = cur.index_select(0, pos).cpu().numpy().view(_NP_INT[w])
            where = pos.to(th.int32).cpu().numpy().astype(np.intp)  # numpy indexes with intp ~2x faster
            return where, values, int(checksum_on_device(cur)) & _MASK

    @staticmethod
    def _copy_whole(src: Any, out: np.ndarray) -> None:
        _torch().from_numpy(out).copy_(src)  # device to host

    @staticmethod
    def _capture(prev: Any, src: Any) -> None:
        prev.copy_(src)  # device to device: the baseline follows what this push read


@contextlib.contextmanager
def baseline_push(baseline: DeviceBaseline | None) -> Iterator[None]:
    """One push's use of a baseline (or none): begin, then end armed only if the push returned."""
    if baseline is None:
        yield
        return
    baseline.begin()
    ok = False
    try:
        yield
        ok = True
    finally:
        baseline.end(ok)


def _torch() -> Any:
    import torch

    return torch


__all__ = ["DeviceBaseline", "DiffStats", "baseline_push"]
