"""The deltafs command line: parse, call the library, print. Errors become one line and an exit code."""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback

import typer

from deltafs.errors import DeltafsError

app = typer.Typer(
    name="deltafs",
    help="Lossless checkpoint deltas on any fsspec filesystem: push, pull, verify, watch.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register() -> None:
    from deltafs.cli import core

    core.register(app)
    for name in ("watch", "gc", "inspect"):
        try:
            module = __import__(f"deltafs.cli.{name}", fromlist=["register"])
        except ModuleNotFoundError as exc:
            if exc.name != f"deltafs.cli.{name}":
                raise
            continue
        module.register(app)


_register()


def error_line(exc: BaseException) -> tuple[str, int]:
    """The one-line message and exit code for an exception."""
    if isinstance(exc, DeltafsError):
        return f"deltafs: error: {exc}", exc.exit_code
    if isinstance(exc, MemoryError):
        return "deltafs: error: out of memory", 1
    if isinstance(exc, OSError):
        return f"deltafs: error: {exc.strerror or exc}{': ' + str(exc.filename) if exc.filename else ''}", 1
    return f"deltafs: internal error: {type(exc).__name__}: {exc} (set DELTAFS_DEBUG=1 for the traceback)", 1


def _setup_logging() -> None:
    """Log lines start with an ISO 8601 UTC timestamp: cron and the watcher append them to files."""
    handler = logging.StreamHandler(sys.stderr)
    formatter = logging.Formatter("%(asctime)s deltafs: %(levelname)s: %(message)s", "%Y-%m-%dT%H:%M:%SZ")
    formatter.converter = time.gmtime
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("DELTAFS_LOG_LEVEL", "WARNING").upper())


def main() -> None:
    _setup_logging()
    try:
        rc = app(standalone_mode=False)
        if isinstance(rc, int) and not isinstance(rc, bool):
            sys.exit(rc)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        sys.stderr.write("deltafs: interrupted\n")
        sys.exit(130)
    except BaseException as exc:  # noqa: BLE001 - the CLI's one place that turns errors into exit codes
        import click

        if isinstance(exc, click.exceptions.Exit):
            sys.exit(exc.exit_code)
        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        if isinstance(exc, click.exceptions.Abort):
            sys.stderr.write("deltafs: aborted\n")
            sys.exit(1)
        if os.environ.get("DELTAFS_DEBUG"):
            traceback.print_exc()
        message, code = error_line(exc)
        sys.stderr.write(message.splitlines()[0] + "\n")
        sys.exit(code)


if __name__ == "__main__":
    main()
