"""Apply a pulled version in place into a live torch.nn.Module, by HF tensor name.

Only tensors whose bytes differ from what the module holds are read and copied, on whatever device
the module lives (CUDA, ROCm, XPU, CPU: copy_ does the transfer). After the copy each touched tensor
is read back and hashed against the manifest's digest, so the module never keeps weights that do
not match a verified version; on any failure the previous version is applied back.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from safetensors import SafetensorError, safe_open

from deltafs.engines.base import SwitchError, SwitchResult, Target
from deltafs.engines.versions import read_version_manifest
from deltafs.errors import DeltafsError, EngineError, IntegrityError
from deltafs.format.manifest import Manifest, Segment

log = logging.getLogger("deltafs.engines.torch")


def tensor_digest(t: torch.Tensor) -> str:
    """xxh3-128 of the tensor's raw bytes, as safetensors stores them (the manifest's segment digest)."""
    flat = t.detach().contiguous().reshape(-1).cpu()
    raw: Any = flat.view(torch.uint8).numpy() if flat.numel() else b""
    return "xxh3-128:" + xxhash.xxh3_128_hexdigest(raw)


def module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by HF name; tied weights appear under every name they have."""
    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        out[name] = p
    for name, b in module.named_buffers(remove_duplicate=False):
        if b is not None:
            out[name] = b
    return out


@dataclass(frozen=True)
class ApplyReport:
    version: int
    changed: int  # tensors copied into the module
    unchanged: int  # tensors already bit-equal
    skipped: tuple[str, ...]  # checkpoint tensors the module does not have (strict=False)
    seconds: float


class ModuleApplier:
    """Keeps the digests of what a module holds so the next apply copies only what changed."""

    def __init__(self, module: torch.nn.Module, *, strict: bool = True) -> None:
        self.module = module
        self.strict = strict
        self._digests: dict[str, str] = {}  # name -> digest known to be in the module now

    def apply(self, version_dir: str, manifest: Manifest | None = None) -> ApplyReport:
        """Copy the tensors of a pulled version that differ from the module's, then verify them."""
        t0 = time.monotonic()
        man = manifest or read_version_manifest(version_dir)
        live = module_tensors(self.module)
        plan: dict[str, list[tuple[str, Segment]]] = {}  # file -> tensors to copy from it
        skipped: list[str] = []
        unchanged = 0
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
                have = self._digests.get(name)
                if have is None:
                    have = tensor_digest(target)  # first apply: learn what the module holds
                    self._digests[name] = have
                if have == seg.digest:
                    unchanged += 1
                else:
                    plan.setdefault(f.path, []).append((name, seg))
        if skipped and self.strict:
            raise EngineError(f"the module has no tensor(s) {', '.join(sorted(skipped)[:5])} of version {man.version}")
        changed = 0
        for rel, items in plan.items():
            with safe_open(os.path.join(version_dir, rel), framework="pt", device="cpu") as fh:
                for name, seg in items:
                    target = live[name]
                    self._digests.pop(name, None)  # unknown until verified below
                    with torch.no_grad():
                        target.copy_(fh.get_tensor(name))
                    got = tensor_digest(target)
                    if got != seg.digest:
                        raise IntegrityError(f"tensor {name} after apply of version {man.version}", expected=seg.digest, actual=got)
                    self._digests[name] = got
                    changed += 1
        return ApplyReport(man.version, changed, unchanged, tuple(sorted(skipped)), time.monotonic() - t0)


def _check_compatible(name: str, target: torch.Tensor, seg: Segment) -> None:
    want_dtype = str(target.dtype).removeprefix("torch.")
    if tuple(target.shape) != tuple(seg.shape or ()):
        raise EngineError(f"tensor {name}: module shape {tuple(target.shape)} != checkpoint shape {seg.shape}")
    if _SAFETENSORS_DTYPES.get(want_dtype) != seg.dtype:
        raise EngineError(f"tensor {name}: module dtype {want_dtype} != checkpoint dtype {seg.dtype}; "
                          "in-place apply is bit-exact and never converts")


_SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e8m0fnu": "F8_E8M0", "complex64": "C64",
    "uint16": "U16", "uint32": "U32", "uint64": "U64",
}


class TorchModuleEngine:
    """An in-process engine: a torch.nn.Module updated in place, under an optional lock.

    The lock is the "pause": hold it in your inference loop around each forward pass and the
    switch waits for the current step, then blocks the next one only while tensors are copied.
    """

    kind = "torch"

    def __init__(self, module: torch.nn.Module, *, lock: threading.Lock | threading.RLock | None = None,
                 strict: bool = True) -> None:
        self.applier = ModuleApplier(module, strict=strict)
        self.lock: AbstractContextManager[Any] = lock if lock is not None else nullcontext()
        self._version: str | None = None

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
        man = read_version_manifest(target.path)  # outside the pause: parse and validate first
        started = time.monotonic()
        with self.lock:
            try:
                report = self.applier.apply(target.path, man)
            except BaseException as exc:  # KeyboardInterrupt too: never keep a half-applied module
                rolled_back = self._rollback(previous)
                if not isinstance(exc, Exception):
                    raise
                raise SwitchError(f"in-place apply of version {target.version} failed: {exc}",
                                  rolled_back=rolled_back, previous=previous) from exc
            self._version = target.version
        pause = time.monotonic() - started
        return SwitchResult(version=target.version, pause_seconds=pause, load_seconds=report.seconds,
                            tensors_changed=report.changed)

    def _rollback(self, previous: Target | None) -> bool:
        if previous is None:
            self._version = None  # partly applied: what the module holds is no known version
            return False
        try:
            self.applier.apply(previous.path)
        except (DeltafsError, OSError, RuntimeError, SafetensorError) as exc:
            log.critical("rollback of the module to version %s failed: %s", previous.version, exc)
            self._version = None
            return False
        self._version = previous.version
        return True
