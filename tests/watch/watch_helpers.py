"""Helpers for watcher tests: a trainer that pushes versions, waiting, weight comparison, a running watcher."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from typing import Callable, Iterator

import torch

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

from sglang_standin import random_weights, tiny_config  # noqa: E402 - after the path set-up

CONFIG = tiny_config()


def wait_until(cond: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def same_weights(live: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    return sorted(live) == sorted(expected) and all(
        torch.equal(live[k].view(torch.uint8), expected[k].contiguous().view(torch.uint8)) for k in expected)


class Trainer:
    """Pushes successive versions of the tiny model, each a small change of the last."""

    def __init__(self, store: str, cache: str, storage_options: dict | None = None) -> None:
        self.store = store
        self.cache = cache
        self.storage_options = storage_options
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self._current = random_weights(CONFIG, 1)

    def push(self, **kwargs: object) -> int:
        from deltafs.publish import push_tensors

        if self.weights:
            step = len(self.weights)
            self._current = {k: v.clone() for k, v in self._current.items()}
            self._current["lm_head.weight"][step % 64] += 0.5
            self._current["logit_bias"][step % 64] = float(step)
        extra = kwargs.pop("extra_files", None) or {"config.json": json.dumps(CONFIG).encode()}
        res = push_tensors(self.store, self._current, extra_files=extra, cache_dir=self.cache,
                           storage_options=self.storage_options, **kwargs)
        self.weights[res.version] = {k: v.clone() for k, v in self._current.items()}
        return res.version


@contextlib.contextmanager
def running(sub) -> Iterator[threading.Thread]:
    """Subscriber.run() in a thread; stopped and joined on exit."""
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(sub.run()), name="watcher", daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        sub.stop()
        thread.join(15)
        assert not thread.is_alive(), "the watcher did not stop"


FAST = {"retry_base": 0.05, "retry_max": 0.3, "fallback_poll": 0.3, "heartbeat": 0.5}
