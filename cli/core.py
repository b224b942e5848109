"""push, pull, verify and log: each resolves its arguments, calls the library and prints."""

from __future__ import annotations


import json
import math
import os
from collections.abc import Callable
from typing import Annotated, Any, Optional

import typer

from deltafs.cli.options import (
    Json,
    FullLevel,
    Level,
    PullVersion,
    PushVersion,
    Quiet,
    StorageOptions,
    Threads,
    Version,
    finite_seconds,
    json_object,
    parse_storage_options,
)
from deltafs.cli.output import Output, human_bytes, one_line
from deltafs.defaults import DEFAULT_FULL_LEVEL, DEFAULT_KEYFRAME_BUDGET, DEFAULT_KEYFRAME_EVERY, DEFAULT_LEVEL
from deltafs.errors import (
    EXIT_BUSY,
    EXIT_CODES,
    EXIT_CURRENT,
    EXIT_OK,
    DeltafsError,
    IntegrityError,
    LockHeldError,
    UsageError,
)


def _non_negative(flag: str) -> Callable[[int], int]:
    def check(value: int) -> int:
        if value < 0:
            raise UsageError(f"{flag} cannot be negative, got {value}")
        return value

    return check


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _metadata(items: list[str] | None, text: str | None) -> dict[str, Any]:
    meta = json_object(text, "--metadata")
    given: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--meta expects KEY=VALUE, got {item!r}")
        # A key given twice silently kept the last value (adversarial pass): say which to keep.
        if key in given:
            raise UsageError(f"--meta {key} is given twice ({given[key]!r} and {value!r}); give each key once")
        if key in meta:
            raise UsageError(f"--meta {key} is also in --metadata; give each key once")
        given[key] = value
        try:
            parsed = json.loads(value, parse_constant=_no_constant)
        except ValueError:
            parsed = value
        # A number JSON cannot hold (NaN, Infinity, 1e400 read as inf) stays the text it was given.
        meta[key] = value if isinstance(parsed, float) and not math.isfinite(parsed) else parsed
    return meta


def push_cmd(
    src: Annotated[str, typer.Argument(help="A .safetensors file or an HF checkpoint directory.")],
    store: Annotated[str, typer.Argument(help="Store URL: a path, file://, memory://, s3://bucket/prefix …")],
    version: PushVersion = None,
    storage_options: StorageOptions = None,
    meta: Annotated[Optional[list[str]], typer.Option("--meta", help="KEY=VALUE metadata (repeatable), e.g. step=1200.")] = None,
    metadata: Annotated[Optional[str], typer.Option("--metadata", help="Metadata as a JSON object.")] = None,
    full: Annotated[bool, typer.Option("--full", help="Store a full version (keyframe) even if a delta is possible.")] = False,
    keyframe_every: Annotated[int, typer.Option("--keyframe-every", callback=_non_negative("--keyframe-every"), help="A full version at least every N versions (0: never).")] = DEFAULT_KEYFRAME_EVERY,
    keyframe_budget: Annotated[float, typer.Option("--keyframe-budget", callback=finite_seconds("--keyframe-budget", unit="full sizes"), help="A full version once the deltas since the last one exceed this many full sizes (0: never).")] = DEFAULT_KEYFRAME_BUDGET,
    fold: Annotated[bool, typer.Option("--fold", help="Also write a folded delta from the last full version, so lagging readers take one step.")] = False,
    bridge: Annotated[bool, typer.Option("--bridge/--no-bridge", help="With a full version, also write its bridge: a delta against the previous version, so hosts that hold it need not read the full version.")] = True,
    cache: Annotated[Optional[str], typer.Option("--cache", help="Push cache directory (default $DELTAFS_CACHE or ~/.cache/deltafs).")] = None,
    level: Level = DEFAULT_LEVEL,
    full_level: FullLevel = DEFAULT_FULL_LEVEL,
    threads: Threads = None,
    include: Annotated[Optional[list[str]], typer.Option("--include", help="Publish only files matching this glob (repeatable), e.g. '*.safetensors'.")] = None,
    exclude: Annotated[Optional[list[str]], typer.Option("--exclude", help="Do not publish files matching this glob (repeatable), e.g. 'logs/*'.")] = None,
    no_default_excludes: Annotated[bool, typer.Option("--no-default-excludes", help="Also publish .cache/, .git/, *.lock, optimizer/scheduler/RNG states (see README).")] = False,
    json_out: Json = False,
    quiet: Quiet = False,
) -> None:
    """Publish SRC as the store's next version (a delta against HEAD, or a full version).

    Examples:
      deltafs push /ckpt/step-1200 /mnt/ckpt-store --meta step=1200
      deltafs push /ckpt/step-1200 s3://bucket/run7 --exclude 'logs/*' --json
    """
    from deltafs.publish import push

    out = Output(json_mode=json_out, quiet=quiet)
    for warning in _store_warnings(src, store):
        out.info(f"deltafs: warning: {warning}")
    res = push(store, src, version=version, metadata=_metadata(meta, metadata), storage_options=parse_storage_options(storage_options),
               cache_dir=cache, progress=out.progress, level=level, full_level=full_level, threads=threads, full=full,
               keyframe_every=keyframe_every or None, keyframe_budget=keyframe_budget or None, fold=fold,
               bridge=bridge, include=include, exclude=exclude, default_excludes=not no_default_excludes)
    data = res.to_json()
    files: dict[str, int] | None
    try:
        files, stored = _stored_bytes(res.store, res.version, parse_storage_options(storage_options))
    except DeltafsError as exc:
        # The version is committed: a store that stopped answering after the commit must not turn this push into a
        # failure (a trainer retrying it would publish the step twice). Only the per-file sizes are missing.
        out.warn(f"deltafs: warning: version {res.version} is committed, but its stored sizes could not be read "
                 f"back: {one_line(str(exc))}")
        files, stored = None, 0  # JSON null: not known (an empty object would say "no files")
    data["files"] = files
    if res.kind == "full":
        with_bridge = f" (and a {human_bytes(res.bridge_bytes)} bridge from version {res.parent})" if res.bridge_bytes else ""
        human = (f"pushed version {res.version} (full) to {res.store}: {human_bytes(res.bytes_written)} written{with_bridge} "
                 f"for {human_bytes(res.full_bytes)} of checkpoint; {res.seconds:.2f}s")
    else:
        if not res.bytes_written:
            ratio = ""
        elif res.bytes_written <= res.full_bytes:
            ratio = f"{res.full_bytes / res.bytes_written:.1f}x smaller than full"
        else:  # (a tiny checkpoint, or one whose every byte changed: the manifest and codec records cost more)
            ratio = f"{res.bytes_written / res.full_bytes:.1f}x the size of the full checkpoint"
        human = (f"pushed version {res.version} (delta) to {res.store}: {human_bytes(res.bytes_written)} written "
                 f"for {human_bytes(res.full_bytes)} of checkpoint, {ratio}; "
                 f"{res.changed_fraction * 100:.2f}% of tensor elements changed; {res.seconds:.2f}s")
    from deltafs import metrics

    metrics.record("push", {"store": res.store},
                   {"deltafs_push_last_version": res.version, "deltafs_push_last_bytes_written": res.bytes_written,
                    "deltafs_push_last_full_bytes": res.full_bytes, "deltafs_push_last_seconds": res.seconds,
                    "deltafs_push_last_timestamp_seconds": metrics.now()},
                   {"deltafs_push_total": 1, "deltafs_push_bytes_written_total": res.bytes_written})
    top = max(files.items(), key=lambda kv: kv[1]) if files else None
    # Worth a line when something other than the weights dominates (an optimizer state, a log).
    if top is not None and stored and top[1] >= 0.5 * stored and not top[0].endswith(".safetensors"):
        human += f"\n  {top[0]} is {top[1] / stored * 100:.0f}% of the stored bytes ({human_bytes(top[1])})"
    out.result(data, human)


def _store_warnings(src: str, store: str) -> list[str]:
    """Swapped or nested arguments that still work but are almost certainly not meant."""
    if "://" in store and not store.startswith("file://"):
        return []
    store_path = os.path.abspath(os.path.expanduser(store.removeprefix("file://")))
    src_path = os.path.abspath(os.path.expanduser(src))
    out = []
    if store_path == src_path or store_path.startswith(src_path.rstrip(os.sep) + os.sep):
        out.append(f"the store {store} is inside the source {src}; its files are not published, but move it out")
    from deltafs.read.dest import sidecar_holding

    if sidecar_holding(store_path) is not None:  # a pulled DEST: push refuses it, and SRC and STORE are not swapped
        return out
    if os.path.isdir(store_path) and not os.path.exists(os.path.join(store_path, "deltafs.json")):
        names = os.listdir(store_path)
        if any(n.endswith(".safetensors") or n == "config.json" for n in names):
            out.append(f"{store} looks like a checkpoint directory, not a store (are SRC and STORE swapped?)")
    return out


def _stored_bytes(store: str, version: int, options: dict[str, Any]) -> tuple[dict[str, int], int]:
    """(payload bytes per file, the version's total): a payload two files share counts once in the total."""
    from deltafs.maintenance.inspect import show

    info = show(store, version, storage_options=options)
    return {f.path: f.stored for f in info.files}, info.stored


def pull_cmd(
    store: Annotated[str, typer.Argument(help="Store URL.")],
    dest: Annotated[str, typer.Argument(help="Local checkpoint path (made a symlink to DEST.deltafs/<version>/).")],
    version: PullVersion = None,
    storage_options: StorageOptions = None,
    force: Annotated[bool, typer.Option("--force", help="Replace a DEST that holds another store's checkpoint or foreign files (moved aside, not deleted).")] = False,
    once: Annotated[bool, typer.Option("--once", help=f"Cron mode: never wait for another pull's lock; exit {EXIT_OK} updated (or repaired), {EXIT_CURRENT} already current, {EXIT_BUSY} busy.")] = False,
    full_check: Annotated[bool, typer.Option("--verify", help="Re-hash every file of the current DEST (default: compare sizes and mtimes recorded at install).")] = False,
    no_chunk_cache: Annotated[bool, typer.Option("--no-chunk-cache", help="Do not keep fetched chunks beside DEST (less disk; a killed pull refetches).")] = False,
    no_recycle: Annotated[bool, typer.Option("--no-recycle", help="Write the new version into new files; by default the files of the oldest version that falls out of the kept two are rewritten (faster, but a process still reading that version sees it change).")] = False,
    engine: Annotated[Optional[str], typer.Option("--engine", help="After an update, reload this engine: sglang, vllm, one an installed package registers, or none (default: sglang when --engine-url is given; see `deltafs watch --help`).")] = None,
    engine_url: Annotated[Optional[str], typer.Option("--engine-url", help="The engine's URL, e.g. http://127.0.0.1:30000.")] = None,
    threads: Threads = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would be read and from where; change nothing.")] = False,
    json_out: Json = False,
    quiet: Quiet = False,
) -> int:
    """Make DEST a complete, verified checkpoint of a version (default: the newest).

    Examples:
      deltafs pull s3://bucket/run7 /models/run7
      deltafs pull /mnt/ckpt-store /models/run7 --once --engine sglang --engine-url http://127.0.0.1:30000
      deltafs pull s3://bucket/run7 /models/run7 --dry-run
    """
    from deltafs.read.pull import pull

    out = Output(json_mode=json_out, quiet=quiet)
    if dry_run:
        return _pull_dry_run(out, store, dest, version, parse_storage_options(storage_options))
    engine = engine or ("sglang" if engine_url else None)  # as `deltafs watch` reads --engine-url alone
    if engine == "none":
        engine = None
    if engine:
        # Before anything is pulled: a misspelled engine or a missing extra must not leave DEST updated
        # and the engine behind.
        from deltafs.engines import make_engine
        from deltafs.watch.signals import install_finish_switch_first

        from deltafs.engines.switch import served_elsewhere

        probe = make_engine(engine, engine_url, api_key=os.environ.get("DELTAFS_ENGINE_API_KEY"))
        install_finish_switch_first()  # SIGTERM (timeout, systemd) lets a running switch finish: never left paused
        # An engine left on an older version (the last run's reload failed) keeps its directory through this pull's
        # cleanup: without it, a version that needs a restart was hot-switched (nothing left to compare with).
        lagging = served_elsewhere(probe, dest) if probe is not None else None
    else:
        lagging = None
    try:
        res = pull(store, dest, version=version, storage_options=parse_storage_options(storage_options), force=force,
                   progress=out.progress, wait_lock=not once, threads=threads, verify_files=full_check,
                   chunk_cache=not no_chunk_cache, recycle=not no_recycle, keep=3 if lagging else 2)
    except LockHeldError as exc:
        if not once:
            raise
        out.info(f"deltafs: {exc}; skipping this run")
        out.result({"status": "busy", "dest": dest}, None)
        return EXIT_BUSY
    data = res.to_json()
    data["status"] = ("repaired" if res.repaired else "updated") if res.updated else "current"
    _pull_metrics(store, dest, res, parse_storage_options(storage_options))
    switched = None
    if engine:
        from deltafs.engines import reload_engine  # optional: only the engine extras need it

        # Every run, "already current" ones too: a run whose pull worked but whose reload failed
        # is repaired by the next run. reload_engine is a no-op when the engine serves the version.
        try:
            switched = reload_engine(engine, engine_url, dest=dest, api_key=os.environ.get("DELTAFS_ENGINE_API_KEY"))
        except LockHeldError as exc:
            if not once:
                raise
            # A watcher (or the previous cron run) is switching this engine right now: the next run reloads it if
            # it still must. The pull's result stands.
            out.info(f"deltafs: {exc}; the engine is not reloaded this run")
            data["engine_reloaded"] = False
            data["status"] = "busy"
            out.result(data, None)
            return EXIT_BUSY
        data["engine_reloaded"] = switched is not None
    if res.repaired:
        human = f"repaired {dest} (version {res.version}): {res.repaired}; {human_bytes(res.bytes_read)} read, {res.seconds:.2f}s"
    elif res.updated:
        how = "from a full version" if res.from_full else f"from version {res.previous}"
        human = f"pulled version {res.version} into {dest} ({how}{', after a fallback' if res.fallback else ''}): {human_bytes(res.bytes_read)} read, {res.seconds:.2f}s"
    else:
        human = f"{dest} already holds version {res.version}"
    out.result(data, human)
    return EXIT_CURRENT if once and not res.updated and switched is None else EXIT_OK


def _pull_metrics(store: str, dest: str, res: Any, options: dict[str, Any]) -> None:
    from deltafs import metrics

    if not os.environ.get(metrics.ENV_VAR):
        return
    from deltafs.store.repo import Repository

    head = Repository.open(store, options).head()
    metrics.record("pull", {"store": store, "dest": os.path.abspath(dest)},
                   {"deltafs_pull_last_version": res.version, "deltafs_pull_last_bytes_read": res.bytes_read,
                    "deltafs_pull_last_seconds": res.seconds, "deltafs_pull_last_timestamp_seconds": metrics.now(),
                    "deltafs_pull_version_lag": max(0, (head.version if head else res.version) - res.version)},
                   {"deltafs_pull_total": 1, "deltafs_pull_bytes_read_total": res.bytes_read})


def _pull_dry_run(out: Output, store: str, dest: str, version: int | None, options: dict[str, Any]) -> int:
    from deltafs.read.inspect import plan_pull

    plan = plan_pull(store, dest, version=version, storage_options=options)
    if plan.up_to_date:
        human = f"{dest} already holds version {plan.version}: nothing to read"
    else:
        start = "a full version" if plan.current is None or plan.steps and plan.steps[0]["kind"] == "full" else f"version {plan.current} in {dest}"
        chain = " -> ".join(f"{s['version']}{' (full)' if s['kind'] == 'full' else ''}{' (fold)' if s['fold'] else ''}"
                            f"{' (bridge)' if s['bridge'] else ''}"
                            for s in plan.steps)
        human = (f"would pull version {plan.version} into {dest} from {start}: apply {chain}; "
                 f"read {plan.objects} chunk objects ({human_bytes(plan.bytes_to_read)}) from {store}, "
                 f"write {human_bytes(plan.bytes_out)}, link {plan.files_linked} unchanged file(s)")
    out.result(plan.to_json(), human)
    return EXIT_OK


def verify_cmd(
    store: Annotated[str, typer.Argument(help="Store URL.")],
    version: Version = None,
    all_versions: Annotated[bool, typer.Option("--all", help="Verify every version in the store.")] = False,
    local: Annotated[Optional[str], typer.Option("--local", help="Verify a pulled DEST against the store instead.")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="Structure and chunk hashes only; skip rebuilding tensors.")] = False,
    storage_options: StorageOptions = None,
    json_out: Json = False,
    quiet: Quiet = False,
) -> int:
    """Recompute chunk, tensor and file digests; exit 0 only if everything matches.

    Examples:
      deltafs verify /mnt/ckpt-store
      deltafs verify s3://bucket/run7 --all
      deltafs verify /mnt/ckpt-store --local /models/run7
    """
    from deltafs.maintenance.verify import verify

    if all_versions and version is not None:
        raise UsageError("use either --version or --all")
    out = Output(json_mode=json_out, quiet=quiet)
    rep = verify(store, version=version, all_versions=all_versions, local=local,
                 storage_options=parse_storage_options(storage_options), deep=not quick)
    if rep.ok:
        if local:
            human = f"ok: {local} verified ({rep.files_checked} files)"
        else:
            what = f"version{'s' if len(rep.versions) > 1 else ''} {', '.join(map(str, rep.versions))}"
            human = f"ok: {what} verified ({rep.chunks_checked} stored objects, {rep.files_checked} files)"
            if rep.bridges_checked:
                human += f"; {rep.bridges_checked} keyframe bridge{'s' if rep.bridges_checked > 1 else ''} rebuilt"
    else:
        human = "\n".join(f"FAILED: {one_line(p)}" for p in rep.problems)
    human += "".join(f"\nwarning: {w}" for w in rep.warnings)
    out.result(rep.to_json(), human)
    if not rep.ok and quiet:
        import sys

        sys.stderr.write(f"deltafs: verify failed: {rep.problems[0]}\n")
    return EXIT_OK if rep.ok else EXIT_CODES[IntegrityError]


def log_cmd(
    store: Annotated[str, typer.Argument(help="Store URL.")],
    storage_options: StorageOptions = None,
    limit: Annotated[Optional[int], typer.Option("--limit", "-n", min=1, help="Only the newest N versions.")] = None,
    since: Annotated[Optional[str], typer.Option("--since", help="Versions >= a number, or created at/after an ISO 8601 UTC time (e.g. 2026-12-01 or 2026-12-01T08:00).")] = None,
    json_out: Json = False,
) -> None:
    """List versions: number, kind, parent, changed fraction, bytes written, ratio to full, time (UTC), metadata.

    A full version (kind "full *") that has a bridge from its parent says so after the time: "bridge 412.3 KiB",
    what a host holding the parent reads instead of the full version.

    Examples:
      deltafs log /mnt/ckpt-store --limit 20
      deltafs log s3://bucket/run7 --since 2026-12-01 --json
    """
    from deltafs.maintenance.log import log

    entries = log(store, storage_options=parse_storage_options(storage_options), limit=limit, since=since)
    out = Output(json_mode=json_out)
    rows = [f"{'version':>8} {'kind':<6} {'parent':>7} {'changed':>8} {'written':>11} {'ratio':>8}  {'created (UTC)':<19}  metadata"]
    for e in entries:
        changed = f"{e.changed_fraction * 100:.2f}%" if e.changed_fraction is not None else "-"
        mark = " *" if e.kind == "full" else ""
        created = e.created.replace("T", " ")[:19]
        meta = " ".join(one_line(f"{k}={json.dumps(v) if not isinstance(v, str) else v}") for k, v in sorted(e.metadata.items()))
        bridge = f"bridge {human_bytes(e.bridge_bytes)}  " if e.bridge_bytes is not None else ""
        rows.append(f"{e.version:>8} {e.kind + mark:<6} {e.parent if e.parent is not None else '-':>7} {changed:>8} "
                    f"{human_bytes(e.bytes_written):>11} {(str(e.ratio) + 'x') if e.ratio and e.kind == 'delta' else '-':>8}  {created:<19}"
                    f"  {bridge}{meta}{'  (HEAD)' if e.head else ''}".rstrip())
    if len(entries) == 0:
        rows.append("(no versions)")
    out.result({"versions": [e.to_json() for e in entries]}, "\n".join(rows))


def register(app: typer.Typer) -> None:
    app.command("push")(push_cmd)
    app.command("pull")(pull_cmd)
    app.command("verify")(verify_cmd)
    app.command("log")(log_cmd)


