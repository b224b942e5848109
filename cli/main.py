"""The deltafs command line: parse, call the library, print. Errors become one line and an exit code."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import sys
import time
import traceback

# numpy's OpenBLAS starts a spinning thread per core when it loads; deltafs never calls BLAS, and on a small host
# those threads cost ~0.1 CPU-s per command (a push of 40 MB: 0.64 -> 0.54 s user). Set before anything imports
# numpy; a value in the environment wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import typer  # noqa: E402

from deltafs.errors import (
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_MEANINGS,
    EXIT_OUTPUT_CLOSED,
    DeltafsError,
    UsageError,
    exit_code,
)
from deltafs.cli.output import OutputClosed, one_line, write_out

app = typer.Typer(
    name="deltafs",
    help="Lossless checkpoint deltas on any fsspec filesystem: push, pull, verify, watch.\n\n"
         "Examples:\n\n"
         "  deltafs push /ckpt/step-1200 s3://bucket/run7 --meta step=1200\n\n"
         "  deltafs pull s3://bucket/run7 /models/run7\n\n"
         "  deltafs watch s3://bucket/run7 /models/run7 --engine sglang --engine-url http://127.0.0.1:30000",
    epilog="Exit codes: " + "; ".join(f"{code} {meaning}" for code, meaning in EXIT_MEANINGS.items()) + ".",
    add_completion=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _show_version(value: bool) -> None:
    if value:
        from deltafs import __version__

        write_out(f"deltafs {__version__}\n")
        raise typer.Exit(0)


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", "-V", help="Print the program version and exit.",
                                 callback=_show_version, is_eager=True),
) -> None:
    """Lossless checkpoint deltas on any fsspec filesystem: push, pull, verify, watch."""
    if ctx.invoked_subcommand is None:  # bare `deltafs`: the help, and success
        write_out(ctx.get_help() + "\n")
        raise typer.Exit(0)


def version_cmd() -> None:
    """Print the program version.

    Examples:
      deltafs version
      deltafs -V
    """
    _show_version(True)


def env_cmd() -> None:
    """Print versions of deltafs, Python and the optional parts (for bug reports).

    Examples:
      deltafs env
    """
    import platform
    from importlib import metadata

    from deltafs import __version__

    lines = [f"deltafs: {__version__}", f"python: {platform.python_version()} ({sys.executable})",
             f"platform: {platform.platform()}"]
    for dist in ("numpy", "safetensors", "zstandard", "xxhash", "fsspec", "typer", "s3fs", "gcsfs", "torch",
                 "requests", "megatron-core", "watchdog"):
        try:
            lines.append(f"{dist}: {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            lines.append(f"{dist}: not installed")
    from deltafs.codec import native

    lines.append(f"codec loops: {native.describe()}")
    from deltafs import buffers

    lines.append("large chunks: " + ("read through guarded mappings (deltafs._mapped)" if buffers.mapping_on()
                                     else "read with pread (deltafs._mapped not built, or the kernel cannot populate)"))
    for var in ("DELTAFS_CACHE", "DELTAFS_STORAGE_OPTIONS", "DELTAFS_METRICS_DIR", "DELTAFS_LOG_LEVEL", "DELTAFS_NATIVE",
                "DELTAFS_SIMD"):
        value = os.environ.get(var)
        if value is not None:
            lines.append(f"{var}: {'(set)' if var == 'DELTAFS_STORAGE_OPTIONS' else value}")
    write_out("\n".join(lines) + "\n")


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
    app.command("version")(version_cmd)
    app.command("env")(env_cmd)


_register()


def error_line(exc: BaseException) -> tuple[str, int]:
    """The one-line message and exit code for an exception."""
    code = exit_code(exc)
    if isinstance(exc, DeltafsError):
        return f"deltafs: error: {exc}", code
    if isinstance(exc, MemoryError):
        return "deltafs: error: out of memory", EXIT_INTERNAL
    if isinstance(exc, OSError):
        hint = " (check its owner and permissions)" if exc.errno in (errno.EACCES, errno.EPERM) else ""
        return f"deltafs: error: {exc.strerror or exc}{': ' + str(exc.filename) if exc.filename else ''}{hint}", code
    return f"deltafs: internal error: {type(exc).__name__}: {exc} (set DELTAFS_DEBUG=1 for the traceback)", code


_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_ALIASES = {"WARN": "WARNING", "FATAL": "CRITICAL"}  # logging's own other names


class _LogFormat(logging.Formatter):
    """`TIME deltafs: LEVEL: message` for deltafs's own lines; another library's lines name that library instead
    (botocore's INFO lines read as deltafs's)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(source)s: %(levelname)s: %(message)s", "%Y-%m-%dT%H:%M:%SZ")
        self.converter = time.gmtime

    def format(self, record: logging.LogRecord) -> str:
        name = record.name.partition(".")[0]
        record.source = "deltafs" if name in ("deltafs", "root") else name
        return super().format(record)


def _setup_logging() -> None:
    """Log lines start with an ISO 8601 UTC timestamp: cron and the watcher append them to files.
    DELTAFS_LOG_LEVEL sets deltafs's level; other libraries log warnings and worse only, unless it is DEBUG."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_LogFormat())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    level = os.environ.get("DELTAFS_LOG_LEVEL", "").strip().upper() or "WARNING"  # empty: unset, as watch takes it
    level = _ALIASES.get(level, level)
    if level not in _LEVELS:
        raise UsageError(f"DELTAFS_LOG_LEVEL must be one of {', '.join(_LEVELS)}, not {os.environ['DELTAFS_LOG_LEVEL']!r}")
    root.setLevel(level if level == "DEBUG" else "WARNING")
    logging.getLogger("deltafs").setLevel(level)


def _stdout_is_null() -> bool:
    try:
        st, null = os.fstat(1), os.stat(os.devnull)
    except (OSError, ValueError):
        return False
    return (st.st_rdev, st.st_ino) == (null.st_rdev, null.st_ino)


def main() -> None:
    # SIGTERM (timeout, systemd, a supervisor) ends a command as Ctrl-C does: its cleanup runs (staging removed,
    # locks released) and it exits 130. Commands that must finish an engine switch first install their own.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    was_null = _stdout_is_null()
    try:
        _setup_logging()
        rc = app(standalone_mode=False)
        if rc == EXIT_INTERRUPTED:  # typer turns Ctrl-C inside a command into this return code
            sys.stderr.write("deltafs: interrupted\n")
        if isinstance(rc, int) and not isinstance(rc, bool):
            sys.exit(rc)
    except SystemExit as exc:
        if exc.code == 1 and (type(sys.stdout).__name__ == "PacifyFlushWrapper" or (not was_null and _stdout_is_null())):
            # click's and rich's own answers to a closed stdout (help text, which typer writes straight to the
            # console): click swaps in that wrapper, rich points stdout at /dev/null; both exit 1, the code of an
            # internal error here.
            sys.exit(EXIT_OUTPUT_CLOSED)
        raise
    except KeyboardInterrupt:
        sys.stderr.write("deltafs: interrupted\n")
        sys.exit(EXIT_INTERRUPTED)
    except OutputClosed:
        # Nothing reads stdout: quiet (a reader such as `head` that stopped is no error to report), and stdout goes
        # to /dev/null so the interpreter's last flush does not complain either.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(EXIT_OUTPUT_CLOSED)
    except BaseException as exc:  # noqa: BLE001 - the CLI's one place that turns errors into exit codes
        from typer.exceptions import TyperException

        if isinstance(exc, typer.Exit):
            sys.exit(exc.exit_code)
        if isinstance(exc, TyperException):  # usage errors: typer's own message, with its "did you mean"
            show = getattr(exc, "show", None)
            if show is not None:
                show()
            else:
                sys.stderr.write(f"deltafs: error: {exc.format_message()}\n")
            sys.exit(exc.exit_code)
        if isinstance(exc, typer.Abort):  # Ctrl-C while typer was reading input or running a command
            sys.stderr.write("deltafs: interrupted\n")
            sys.exit(EXIT_INTERRUPTED)
        if os.environ.get("DELTAFS_DEBUG"):
            traceback.print_exc()
        message, code = error_line(exc)
        sys.stderr.write(one_line(message.splitlines()[0] if message.strip() else message) + "\n")
        sys.exit(code)


if __name__ == "__main__":
    main()
