"""What the engine stand-in servers and the engine adapter tests share.

Server side (tests/sglang_standin.py, tests/sglang_wheel_server.py, tests/engines/vllm_standin.py):
ServerControls, the event log a test reads and the faults it injects (ModelServerControls: and
the weights the stand-in serves). Test side: wait_for,
same_weights and interrupted_after (the `ckpts` fixture is in tests/engines/conftest.py). It lives
beside sglang_standin.py, not in tests/engines/, because tests/watch imports the stand-ins too.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch


# --- server side ------------------------------------------------------------------------------------
@dataclass
class Fault:
    kind: str
    seconds: float = 0.0
    remaining: int = 1


@dataclass
class Event:
    at: float
    what: str
    detail: dict[str, Any] = field(default_factory=dict)


class ServerControls:
    """The event log a test reads (record, count) and the faults it injects for the next loads."""

    FAULTS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, guard: AbstractContextManager[Any]) -> None:
        self.events: list[Event] = []
        self._faults: list[Fault] = []
        self._guard = guard  # the server's own lock, so events and faults change under it

    def inject(self, kind: str, *, count: int = 1, seconds: float = 0.0) -> None:
        """Make the next `count` weight loads fail (or be slow) in the given way."""
        if kind not in self.FAULTS:
            raise ValueError(f"unknown fault {kind!r}; one of {self.FAULTS}")
        with self._guard:
            self._faults.append(Fault(kind, seconds, count))

    def take_fault(self) -> Fault | None:
        with self._guard:
            if not self._faults:
                return None
            fault = self._faults[0]
            fault.remaining -= 1
            if fault.remaining <= 0:
                self._faults.pop(0)
            return fault

    def clear_faults(self) -> None:
        with self._guard:
            self._faults.clear()

    def record(self, what: str, **detail: Any) -> None:
        with self._guard:
            self.events.append(Event(time.time(), what, detail))

    def count(self, what: str) -> int:
        with self._guard:
            return sum(1 for e in self.events if e.what == what)


class ModelServerControls(ServerControls):
    """ServerControls of a stand-in serving a torch model at self.model, which a test reads back."""

    model: torch.nn.Module

    def state_dict(self) -> dict[str, torch.Tensor]:
        with self._guard:
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


# --- test side --------------------------------------------------------------------------------------
def wait_for(cond: Callable[[], bool], timeout: float = 10.0, interval: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(interval)


def same_weights(live: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    """The same tensor names, each bit-identical."""
    return sorted(live) == sorted(expected) and all(
        torch.equal(live[n].view(torch.uint8), t.contiguous().view(torch.uint8)) for n, t in expected.items())


@contextmanager
def interrupted_after(seconds: float) -> Iterator[None]:
    """Raise KeyboardInterrupt in the main thread after seconds, as Ctrl-C would."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
