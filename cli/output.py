"""One output object: data on stdout (human text or one JSON object), messages on stderr."""

from __future__ import annotations

import json
import sys
from typing import Any

from deltafs.progress import binary_size


# Control characters other than newline and tab, as escapes: text a store controls (file paths, tensor names,
# metadata) must not move the cursor, clear the screen or set a window title through `show`, `log` or `verify`.
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x09), *range(0x0b, 0x20), *range(0x7f, 0xa0))}
# ... and the invisible marks that reorder text (bidi overrides and isolates, "Trojan Source"): a metadata value or a
# tensor name must not display as something else.
_CONTROL.update({c: f"\\u{c:04x}" for c in (0x061c, 0x200e, 0x200f, *range(0x202a, 0x202f), *range(0x2066, 0x206a))})


class OutputClosed(Exception):
    """stdout was closed before the result was written (`deltafs log STORE | head -0`, a reader that died). Not an
    OSError, so click does not turn it into its own exit 1; the CLI's main() exits EXIT_OUTPUT_CLOSED."""


def write_out(text: str) -> None:
    """text on stdout, flushed; OutputClosed if nothing reads it any more."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise OutputClosed() from None


def terminal_safe(text: str) -> str:
    return text.translate(_CONTROL)


def one_line(text: str) -> str:
    """terminal_safe, with newlines escaped too: for a value that must stay on its line (one problem, one row)."""
    return terminal_safe(text).replace("\n", "\\n").replace("\t", "\\t")


class Output:
    def __init__(self, *, json_mode: bool = False, quiet: bool = False) -> None:
        self.json_mode = json_mode
        self.quiet = quiet

    @property
    def progress(self) -> bool:
        """Progress bars only for a person at a terminal."""
        return not (self.json_mode or self.quiet)

    def result(self, data: Any, human: str | None = None) -> None:
        if self.json_mode:
            write_out(json.dumps(data, sort_keys=True) + "\n")
        elif not self.quiet and human is not None:
            write_out(terminal_safe(human.rstrip("\n")) + "\n")

    def info(self, message: str) -> None:
        if not self.quiet and not self.json_mode:
            sys.stderr.write(terminal_safe(message) + "\n")

    def warn(self, message: str) -> None:
        """A warning a script must see too: on stderr in JSON mode as well (stdout keeps its one object)."""
        if not self.quiet:
            sys.stderr.write(terminal_safe(message) + "\n")


human_bytes = binary_size  # one format for sizes, the CLI's and the logs'
