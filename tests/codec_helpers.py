"""The codec tests' switch between the compiled loops and numpy: every codec path has both, with the same bytes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from deltafs.codec import native
from deltafs.errors import FormatError, IntegrityError


@contextmanager
def loops(use: bool) -> Iterator[None]:
    """The compiled loops on (where built) or off inside the block; as built afterwards."""
    native.enabled = use and native.BUILT
    try:
        yield
    finally:
        native.enabled = native.BUILT


def each_path(fn: Callable[[], Any]) -> list[Any]:
    """fn() with the compiled loops (where built) and with numpy: each a result or the refusal's class."""
    out: list[Any] = []
    for use in ((True, False) if native.BUILT else (False,)):
        with loops(use):
            try:
                out.append(fn())
            except (FormatError, IntegrityError) as exc:
                out.append(type(exc))
    return out
