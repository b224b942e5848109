"""deltafs: lossless checkpoint deltas on any fsspec filesystem.

The public API, imported lazily so that `import deltafs` (and the CLI's start-up) stays cheap:

    from deltafs import push, push_tensors, push_distributed, pull, verify, log, gc, Repository
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0.dev0"

_EXPORTS = {
    "push": "deltafs.publish",
    "push_tensors": "deltafs.publish",
    "push_distributed": "deltafs.publish",
    "DeviceBaseline": "deltafs.publish",
    "PushResult": "deltafs.publish",
    "PushOptions": "deltafs.publish",
    "pull": "deltafs.read",
    "PullResult": "deltafs.read",
    "verify": "deltafs.maintenance.verify",
    "log": "deltafs.maintenance.log",
    "gc": "deltafs.maintenance.gc",
    "Repository": "deltafs.store.repo",
}

__all__ = [  # spelled out for linters and type checkers; the same names as _EXPORTS
    "DeviceBaseline", "PullResult", "PushOptions", "PushResult", "Repository", "__version__", "gc", "log", "pull", "push",
    "push_distributed", "push_tensors", "verify",
]

if TYPE_CHECKING:
    from deltafs.maintenance.gc import gc
    from deltafs.maintenance.log import log
    from deltafs.maintenance.verify import verify
    from deltafs.publish.device_diff import DeviceBaseline
    from deltafs.publish.distributed import push_distributed
    from deltafs.publish.options import PushOptions, PushResult
    from deltafs.publish.push import push, push_tensors
    from deltafs.read.pull import PullResult, pull
    from deltafs.store.repo import Repository


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'deltafs' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
