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
            from rich.progress import BarColumn, DownloadColumn, Progress as RichProgress, TextColumn, TimeRemainingColumn

            # Binary units, as every result line prints them (rich's speed column is decimal).
            self._bar = RichProgress(
                "[progress.description]{task.description}", BarColumn(), DownloadColumn(binary_units=True),
                TextColumn("{task.fields[speed]}"), TimeRemainingColumn(), console=Console(stderr=True), transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=self.total, speed="")
        return self

    def advance(self, n: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)
            speed = self._bar.tasks[0].speed
            if speed:
                self._bar.update(self._task, speed=f"{binary_rate(speed)}")

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.stop()


def binary_size(n: float) -> str:
    """A size in binary units (B, KiB, MiB, GiB, TiB): what the CLI and the logs print."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def binary_rate(per_second: float) -> str:
    """Bytes per second in binary units (KiB/s, MiB/s, GiB/s)."""
    for unit in ("B/s", "KiB/s", "MiB/s", "GiB/s"):
        if per_second < 1024 or unit == "GiB/s":
            return f"{per_second:.1f} {unit}"
        per_second /= 1024
    return f"{per_second:.1f} GiB/s"
