"""The one small interface every inference-engine adapter implements.

The watcher only ever asks an engine three things: which weight version it serves, whether it is
busy (for the idle boundary), and to switch to a verified checkpoint directory, going back to the
previous one if the switch fails. Everything engine-specific stays in the adapter modules.

Two optional methods, asked for with getattr by deltafs.engines.switch: `served_path()` (the
directory the engine last loaded, to learn its version when it reports none) and
`loaded_checksum()` (a checksum of the weights it holds, recorded in the fleet ledger).
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
    checksum: str | None = None  # of the loaded weights, where the engine can report one


class SwitchError(EngineError):
    """A switch failed; the engine was sent back to the previous version (or could not be).

    `serving` is what the engine is known to hold now: `previous` after a verified rollback, the
    target when its load was verified but a later step (resuming) failed, None when unknown.
    `paused`: resuming generation failed, so the engine may still be paused (the caller must resume it).
    """

    def __init__(self, message: str, *, rolled_back: bool, previous: Target | None,
                 serving: Target | None = None, paused: bool = False) -> None:
        self.rolled_back = rolled_back
        self.previous = previous
        self.serving = serving if serving is not None else (previous if rolled_back else None)
        self.paused = paused
        super().__init__(message)


class NeedsRestartError(EngineError):
    """The version changes more than weights (config, tokenizer, tensor set): a hot switch would be wrong."""

    def __init__(self, version: str, reason: str) -> None:
        self.version = version
        self.reason = reason
        super().__init__(f"version {version} needs an engine restart, not a hot switch: {reason}")


class EngineUnreachableError(EngineError):
    """No connection could be made: the request never reached the engine."""


@runtime_checkable
class Engine(Protocol):
    """An inference engine the watcher can switch between checkpoint versions."""

    kind: str

    def served_version(self) -> str | None:
        """The weight version the engine reports now; raises EngineError if it cannot be asked."""
        ...

    def busy_requests(self) -> int | None:
        """Requests running or queued now; None if the engine has no notion of load.

        Raises EngineError when the engine has one but cannot be asked (an error is never "idle").
        """
        ...

    def resume(self) -> None:
        """Make sure the engine is generating (undo a pause left by a killed watcher)."""
        ...

    def switch(self, target: Target, previous: Target | None) -> SwitchResult:
        """Load target with the shortest pause; on failure reload previous and raise SwitchError.

        Must never return or raise with the engine paused.
        """
        ...
