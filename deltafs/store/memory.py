"""memory:// (fsspec's process-local memory filesystem), for tests and demos."""

from __future__ import annotations

import threading

from deltafs.store.base import Capabilities
from deltafs.store.fsspec import FsspecObjectStore


class MemoryObjectStore(FsspecObjectStore):
    """Process-local, so a lock makes create-if-absent atomic."""

    capabilities = Capabilities(atomic_put=True, atomic_create=True)
    _lock = threading.Lock()

    def _create(self, key: str, data: bytes, equal_is_ours: bool = True) -> bool:
        with self._lock:
            return super()._create(key, data, equal_is_ours)
