"""What a push asks of torch about accelerators: torch itself, imported on first use, and waiting for the work
queued on them."""

from __future__ import annotations

from typing import Any


def lazy_torch() -> Any:
    """torch, imported on first use: `import deltafs` and the CLI stay free of it."""
    import torch

    return torch


def wait_for_devices(devices: set[str]) -> None:
    """Wait until the work queued on these accelerators (on every stream) has run.

    The push's workers copy from their own threads, whose current stream is the device's default one: without
    this, a tensor the caller wrote on another stream (an optimizer step under `torch.cuda.stream(s)`) could be
    copied before that write lands. Once per push and device; the old whole-model copy waited as long.
    """
    if not devices:
        return
    torch = lazy_torch()
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6: CUDA, ROCm, XPU, MPS ... alike
    current = accelerator.current_accelerator() if accelerator is not None else None
    for device in sorted(devices):
        dev = torch.device(device)
        if current is not None and dev.type == current.type:
            accelerator.synchronize(dev)  # type: ignore[union-attr]
        elif dev.type == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize(dev)
        # Anything else (meta, a device torch cannot synchronize) has no queued work to wait for.


__all__ = ["lazy_torch", "wait_for_devices"]
