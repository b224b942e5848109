"""`deltafs watch` (the rollout-host daemon), `deltafs status` (the fleet ledger), `deltafs launch-args`."""

from __future__ import annotations

import datetime as _dt
import enum
import logging
import os
import shlex
import signal
from typing import Annotated, Any

import typer
from deltafs.cli.options import Json, Quiet, StorageOptions, finite_seconds, parse_storage_options
from deltafs.cli.output import Output

from deltafs.defaults import (
    DEFAULT_GROUP_TIMEOUT,
    DEFAULT_HOST_STALE_AFTER,
    DEFAULT_LOAD_TIMEOUT,
    DEFAULT_MAX_WAIT,
    DEFAULT_RETRY_MAX,
)
from deltafs.errors import EXIT_INTERNAL, EXIT_OK, UsageError

# `status`: some host has a problem (the exit-code table's 1: see deltafs.errors.EXIT_MEANINGS).
EXIT_FLEET_PROBLEM = EXIT_INTERNAL


class PauseMode(str, enum.Enum):
    """--pause-mode's choices, shown in --help (each engine accepts its own; see the help text)."""

    abort = "abort"
    retract = "retract"
    in_place = "in_place"
    wait = "wait"
    keep = "keep"


class BoundaryKind(str, enum.Enum):
    """--boundary's choices, shown in --help."""

    immediate = "immediate"
    idle = "idle"
    signal = "signal"


def watch_cmd(
    store: Annotated[str, typer.Argument(help="Store URL: a path, file://, s3://bucket/prefix …")],
    dest: Annotated[str, typer.Argument(help="Local checkpoint path the engine loads from (a symlink deltafs manages).")],
    engine: Annotated[str | None, typer.Option("--engine", help="sglang, vllm, one an installed package registers, or none (default: sglang when --engine-url is given, else none).")] = None,
    engine_url: Annotated[str | None, typer.Option("--engine-url", help="The engine's URL, e.g. http://127.0.0.1:30000.")] = None,
    pause_mode: Annotated[PauseMode, typer.Option("--pause-mode", help="How the engine pauses for the switch: SGLang abort, retract or in_place; vLLM abort, wait or keep (retract means keep).")] = PauseMode.retract,
    boundary: Annotated[BoundaryKind, typer.Option("--boundary", help="When to switch: immediate, idle (no running requests) or signal.")] = BoundaryKind.immediate,
    max_wait: Annotated[float | None, typer.Option("--max-wait", callback=finite_seconds("--max-wait", positive=True), help=f"idle: switch anyway after this many seconds (default {DEFAULT_MAX_WAIT:g}).")] = None,
    boundary_file: Annotated[str | None, typer.Option("--boundary-file", help="signal: touching this file says 'switch now'.")] = None,
    boundary_port: Annotated[int | None, typer.Option("--boundary-port", help="signal: also accept POST http://127.0.0.1:PORT/boundary.")] = None,
    poll: Annotated[float | None, typer.Option("--poll", callback=finite_seconds("--poll", positive=True), help="Poll HEAD every SECONDS instead of file events (NFS, FUSE); remote stores always poll (default 5s).")] = None,
    storage_options: StorageOptions = None,
    host_id: Annotated[str | None, typer.Option("--host-id", help="Name in the fleet ledger (default: the host name; set one per engine if a host runs several).")] = None,
    no_ledger: Annotated[bool, typer.Option("--no-ledger", help="Do not write fleet/<host-id>.json to the store.")] = False,
    no_recycle: Annotated[bool, typer.Option("--no-recycle", help="Pull each version into new files instead of rewriting those of the oldest kept version (see `deltafs pull --help`).")] = False,
    load_timeout: Annotated[float, typer.Option("--load-timeout", callback=finite_seconds("--load-timeout", positive=True), help="Seconds the engine may take to load a version.")] = DEFAULT_LOAD_TIMEOUT,
    verify_rollback: Annotated[bool, typer.Option("--verify-rollback", help="vLLM: record vLLM's sha256 of every weight before each load and count a rollback as done only if they match again (costs a copy of every weight to the host, inside the pause).")] = False,
    retry_max: Annotated[float, typer.Option("--retry-max", callback=finite_seconds("--retry-max", positive=True), help="Longest wait between retries after failures, in seconds.")] = DEFAULT_RETRY_MAX,
    once: Annotated[bool, typer.Option("--once", help="One cycle (stage, boundary, switch), then exit: 0 done or current, else the error's code.")] = False,
    engine_group: Annotated[str | None, typer.Option("--engine-group", help="Multi-node engine: the name all its hosts' watchers share (same DEST path on each).")] = None,
    engine_hosts: Annotated[int, typer.Option("--engine-hosts", help="Multi-node engine: how many hosts it spans; the --engine-url host switches once all have the version staged.")] = 1,
    group_timeout: Annotated[float, typer.Option("--group-timeout", callback=finite_seconds("--group-timeout", positive=True), help="Multi-node engine: report a failure when a host has not staged a version after this many seconds.")] = DEFAULT_GROUP_TIMEOUT,
    quiet: Quiet = False,
) -> int:
    """Keep DEST and the engine at the store's newest verified version, switching at task boundaries.

    Examples:
      deltafs watch s3://bucket/run7 /models/run7 --engine sglang --engine-url http://127.0.0.1:30000
      deltafs watch /mnt/ckpt-store /models/run7 --boundary idle
      deltafs watch s3://bucket/run7 /models/run7 --engine-url http://127.0.0.1:30000 --engine-group big --engine-hosts 2
      deltafs watch s3://bucket/run7 /models/run7 --engine vllm --engine-url http://127.0.0.1:8000 --verify-rollback
    """
    from deltafs.engines import make_engine
    from deltafs.watch.boundary import make_boundary
    from deltafs.watch.subscriber import Subscriber

    _log_to_stderr(quiet)
    kind = engine or ("sglang" if engine_url else "none")
    # SGLang's --api-key and --admin-api-key come from DELTAFS_ENGINE_API_KEY and
    # DELTAFS_ENGINE_ADMIN_API_KEY (make_engine reads them), never flags: flags show up in ps.
    options: dict[str, Any] = {"pause_mode": pause_mode.value, "load_timeout": load_timeout,
                               "api_key": os.environ.get("DELTAFS_ENGINE_API_KEY")}
    if verify_rollback:
        if kind != "vllm":  # only vLLM's in-place reload can succeed and still keep tensors of another version
            raise UsageError(f"--verify-rollback works with --engine vllm only, not {kind}")
        options["verify_rollback"] = True
    eng = make_engine(kind, engine_url, **options) if kind != "none" else None
    if engine_hosts < 1:
        raise UsageError(f"--engine-hosts must be at least 1, not {engine_hosts}")
    if engine_hosts > 1 and not engine_group:
        raise UsageError("--engine-hosts needs --engine-group NAME (the same on every host of the engine)")
    # Options of one boundary kind given with another were ignored without a word (a unit file that says
    # --boundary-file but forgot --boundary signal switched at once, every time).
    if max_wait is not None and boundary is not BoundaryKind.idle:
        raise UsageError(f"--max-wait applies to --boundary idle, not {boundary.value}")
    for flag, value in (("--boundary-file", boundary_file), ("--boundary-port", boundary_port)):
        if value is not None and boundary is not BoundaryKind.signal:
            raise UsageError(f"{flag} applies to --boundary signal, not {boundary.value}")
    bound = make_boundary(boundary.value, max_wait=max_wait if max_wait is not None else DEFAULT_MAX_WAIT,
                          file=boundary_file, port=boundary_port)
    sub = Subscriber(store, dest, eng, storage_options=parse_storage_options(storage_options), boundary=bound,
                     host_id=host_id, ledger=not no_ledger, poll=poll, retry_max=retry_max, engine_group=engine_group,
                     engine_hosts=engine_hosts, group_timeout=group_timeout, recycle=not no_recycle)
    if once:
        from deltafs.watch.signals import install_finish_switch_first

        install_finish_switch_first()  # SIGTERM (timeout, systemd) lets a running switch finish: never left paused
        try:
            sub.start()
            sub.once()
            return EXIT_OK
        finally:
            sub.close(stopped=False)  # one cycle: the host is not "stopped" (a daemon may serve beside it)
    # SIGTERM (systemd stop) and Ctrl-C end the loop in order: a switch in progress completes
    # and resumes the engine before the process exits. stop() runs in a thread: see deltafs.watch.signals.
    from deltafs.watch.signals import handler, warn_and_ignore

    # SIGHUP too: a watcher started from an ssh or tmux session that goes away was killed mid-switch, the engine
    # left paused (adversarial pass).
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, handler(sub.stop, "deltafs-stop"))
    if boundary is not BoundaryKind.signal:
        # SIGUSR1 says "switch now" to a watcher with --boundary signal; sent to another, it killed it (mid-switch
        # too). Ignored there, with a line on stderr.
        warn_and_ignore(signal.SIGUSR1, f"this watcher switches at --boundary {boundary.value}, not on signals")
    return sub.run()


def status_cmd(
    store: Annotated[str, typer.Argument(help="Store URL.")],
    storage_options: StorageOptions = None,
    stale_after: Annotated[float, typer.Option("--stale-after", callback=finite_seconds("--stale-after", positive=True), help="A host silent for this many seconds is reported stale.")] = DEFAULT_HOST_STALE_AFTER,
    prune_after: Annotated[float | None, typer.Option("--prune-after", callback=finite_seconds("--prune-after"), help="First delete the entries of hosts silent for more than this many seconds (retired hosts).")] = None,
    json_out: Json = False,
) -> int:
    """Show the fleet: which host serves which version, lag behind HEAD, failures. Exit 1 if any host has a problem.

    Examples:
      deltafs status s3://bucket/run7
      deltafs status /mnt/ckpt-store --json
      deltafs status s3://bucket/run7 --prune-after 86400
    """
    from deltafs.store.repo import Repository
    from deltafs.watch.ledger import fleet_report

    out = Output(json_mode=json_out)
    repo = Repository.open(store, parse_storage_options(storage_options))
    if prune_after is not None:
        from deltafs.watch.ledger import prune_statuses

        for host in prune_statuses(repo.objects, prune_after):
            out.info(f"deltafs: removed host {host} (silent for more than {prune_after:g}s)")
    report = fleet_report(repo, stale_after=stale_after)
    out.result(report.to_json(), render_fleet(report))
    return EXIT_OK if report.healthy else EXIT_FLEET_PROBLEM


def launch_args_cmd(
    dest: Annotated[str, typer.Argument(help="The DEST a watcher keeps (the path SGLang loads).")],
    json_out: Json = False,
) -> int:
    """Print the SGLang arguments that start a replica at the version DEST holds (--model-path DEST --weight-version N).

    Examples:
      python -m sglang.launch_server $(deltafs launch-args /models/run7) --port 30000
      deltafs launch-args /models/run7 --json
    """
    from deltafs.engines.sglang import launch_args
    from deltafs.errors import DestinationError
    from deltafs.read.dest import LocalCheckpoint

    local = LocalCheckpoint(dest)
    state = local.state()
    if state is None:
        raise DestinationError(f"{local.dest} holds no verified deltafs version; run deltafs pull first")
    args = launch_args(local.dest, state.version)
    Output(json_mode=json_out).result({"dest": local.dest, "version": state.version, "args": args},
                                      " ".join(shlex.quote(a) for a in args))
    return EXIT_OK


def render_fleet(report: Any) -> str:
    lines = [f"store {report.store_url}: HEAD is version {report.head if report.head is not None else '(none)'}"]
    if report.head is not None and report.head_object != report.head:
        named = "is missing" if report.head_object is None else f"still names version {report.head_object}"
        lines[0] += (f" (the HEAD object {named}: a push committed version {report.head} but did not move it;"
                     " the next push does)")
    if report.head_problem:
        lines.append(f"problem: {report.head_problem}")
    if not report.hosts:
        lines.append("no watcher has reported yet")
        return "\n".join(lines)
    rows = [("HOST", "STATE", "SERVES", "LAG", "STAGED", "LAST SWITCH", "SEEN", "PROBLEM")]
    for r in report.hosts:
        st = r.status
        if st is None:
            rows.append((r.key, "?", "?", "?", "-", "-", "-", r.problem or ""))
            continue
        sync = st.last_sync or {}
        last = f"v{sync['version']} pause {sync['pause_s']:.2f}s / {sync['sync_s']:.2f}s" if sync else "-"
        note = r.problem or (st.group_wait if st.state == "waiting-group" else "") or ""
        rows.append((st.host_id, st.state, _v(st.served_version), "-" if r.lag is None else str(r.lag),
                     _v(st.staged_version), last, _ago(st.updated_at), note))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def _v(version: int | None) -> str:
    return "-" if version is None else str(version)


def _ago(stamp: str | None) -> str:
    from deltafs.watch.ledger import parse_time

    when = parse_time(stamp)
    if when is None:
        return "?"
    secs = int((_dt.datetime.now(_dt.timezone.utc) - when).total_seconds())
    return f"{secs}s ago" if secs < 120 else f"{secs // 60}m ago" if secs < 7200 else f"{secs // 3600}h ago"


def _log_to_stderr(quiet: bool) -> None:
    """A daemon's log is its output: INFO lines (one per version) unless --quiet or DELTAFS_LOG_LEVEL."""
    logger = logging.getLogger("deltafs")
    if not os.environ.get("DELTAFS_LOG_LEVEL", "").strip():  # set: the CLI's entry point has applied it
        logger.setLevel("WARNING" if quiet else "INFO")
    if not logging.getLogger().handlers and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("deltafs: %(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(handler)


def register(app: typer.Typer) -> None:
    app.command("watch")(watch_cmd)
    app.command("status")(status_cmd)
    app.command("launch-args")(launch_args_cmd)
