"""The one small interface every inference-engine adapter implements.

The watcher only ever asks an engine three things: which weight version it serves, whether it is
busy (for the idle boundary), and to switch to a verified checkpoint directory, going back to the
previous one if the switch fails. Everything engine-specific stays in the adapter modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from deltafs.errors import EngineError


@dataclass(frozen=True)
class Target:
    """A verified checkpoint directory and the weight version the engine should report for it."""

    path: str
    version: str


@dataclass(frozen=True)
class SwitchResult:
    """What one successful switch cost."""

    version: str
    pause_seconds: float  # the engine was not generating for this long
    load_seconds: float  # of which the weight load itself took this long
    tensors_changed: int | None = None  # known by in-process adapters only


class SwitchError(EngineError):
    """A switch failed; the engine was sent back to the previous version (or could not be).

    `rolled_back` tells which: True means the engine serves `previous` again (verified by asking
    it), False means it serves something unknown and an operator should look.
    """

    def __init__(self, message: str, *, rolled_back: bool, previous: Target | None) -> None:
        self.rolled_back = rolled_back
        self.previous = previous
        super().__init__(message)


@runtime_checkable
class Engine(Protocol):
    """An inference engine the watcher can switch between checkpoint versions."""

    kind: str

    def served_version(self) -> str | None:
        """The weight version the engine reports now; raises EngineError if it cannot be asked."""
        ...

    def busy_requests(self) -> int | None:
        """Requests running or queued now; None if the engine cannot tell."""
        ...

    def resume(self) -> None:
        """Make sure the engine is generating (undo a pause left by a killed watcher)."""
        ...

    def switch(self, target: Target, previous: Target | None) -> SwitchResult:
        """Load target with the shortest pause; on failure reload previous and raise SwitchError.

        Must never return or raise with the engine paused.
        """
        ...
