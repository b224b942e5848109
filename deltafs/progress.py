"""A progress bar on a terminal (rich), silent otherwise."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any


class Progress:
    """Context manager; advance(n) adds bytes. Disabled unless asked for and stderr is a TTY."""

    def __init__(self, label: str, total: int, *, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.label = label
        self.total = total
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress as RichProgress, TimeRemainingColumn, TransferSpeedColumn

            self._bar = RichProgress(
                "[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                TimeRemainingColumn(), console=Console(stderr=True), transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=self.total)
        return self

    def advance(self, n: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.stop()
