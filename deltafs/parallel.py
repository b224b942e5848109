"""Bounded, order-preserving parallel map: numpy, zstd, hashing and store I/O release the GIL."""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Generator, Iterable, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def ordered_map(fn: Callable[[T], R], items: Iterable[T], threads: int, window: int | None = None) -> Generator[R, None, None]:
    """Yield fn(item) in input order, with at most `window` items in flight (bounds memory)."""
    if threads <= 1:
        for item in items:
            yield fn(item)
        return
    window = window or threads * 2
    pending: deque[Future[R]] = deque()
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="deltafs") as pool:
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) >= window:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for fut in pending:
                fut.cancel()
