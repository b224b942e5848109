"""deltafs gc: retention for a store (plan, then execute under the store's gc lock)."""

from __future__ import annotations

from typing import Annotated

import typer

from deltafs.cli.options import Json, Quiet, StorageOptions, finite_seconds, parse_storage_options
from deltafs.cli.output import Output, human_bytes
from deltafs.defaults import DEFAULT_GRACE


def gc_cmd(
    store: Annotated[str, typer.Argument(help="Store URL.")],
    keep_last: Annotated[int, typer.Option("--keep-last", help="Keep the newest N versions (and what they need).")],
    keep_full: Annotated[int, typer.Option("--keep-full", help="Also keep the newest M full versions.")] = 0,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only print what would be removed and the bytes freed.")] = False,
    grace: Annotated[float, typer.Option("--grace", callback=finite_seconds("--grace"), help="Seconds a version stays after it stopped being HEAD, and an unreferenced chunk after it was written (protects pulls and pushes in flight).")] = DEFAULT_GRACE,
    wait: Annotated[float, typer.Option("--wait", callback=finite_seconds("--wait"), help="Seconds to wait for another gc's lock (default: exit at once).")] = 0.0,
    storage_options: StorageOptions = None,
    json_out: Json = False,
    quiet: Quiet = False,
) -> None:
    """Remove old versions and every chunk no kept version references.

    Examples:
      deltafs gc /mnt/ckpt-store --keep-last 20 --dry-run
      deltafs gc s3://bucket/run7 --keep-last 20 --keep-full 2
    """
    from deltafs.maintenance.gc import gc

    out = Output(json_mode=json_out, quiet=quiet)
    res = gc(store, keep_last=keep_last, keep_full=keep_full, grace=grace, dry_run=dry_run, wait=wait,
             storage_options=parse_storage_options(storage_options))
    plan = res.plan
    kept = ", ".join(f"{v} ({why})" for v, why in sorted(plan.keep.items())) or "-"
    removed = ", ".join(map(str, sorted(plan.remove))) or "none"
    verb = "would remove" if dry_run else "removed"
    lines = [
        f"keep versions: {kept}",
        f"{verb} versions: {removed}",
        f"{verb} {len(plan.chunks)} chunks; {human_bytes(plan.bytes_freed)} {'would be ' if dry_run else ''}freed",
    ]
    if plan.folds:
        lines.append(f"{verb} the folded deltas of versions {', '.join(map(str, sorted(plan.folds)))}")
    if plan.bridges:
        lines.append(f"{verb} the bridges of versions {', '.join(map(str, sorted(plan.bridges)))}")
    if plan.temp_files:
        lines.append(f"{verb} {len(plan.temp_files)} partial files left by killed writers")
    if plan.chunks_too_young:
        lines.append(f"left {plan.chunks_too_young} unreferenced chunks younger than --grace {grace:g}s (a push in flight?)")
    out.result(res.to_json(), "\n".join(lines))


def register(app: typer.Typer) -> None:
    app.command("gc")(gc_cmd)
