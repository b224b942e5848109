"""show and diff: look into a store without pulling it."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from deltafs.cli.options import Json, StorageOptions, Version, parse_storage_options
from deltafs.cli.output import Output, human_bytes, one_line


def show_cmd(
    store: Annotated[str, typer.Argument(help="Store URL.")],
    version: Version = None,
    tensors: Annotated[bool, typer.Option("--tensors", help="List every tensor (dtype, shape, stored bytes, codecs).")] = False,
    storage_options: StorageOptions = None,
    json_out: Json = False,
) -> None:
    """One version's files, tensors, codecs, sizes and metadata (default: HEAD).

    Examples:
      deltafs show /mnt/ckpt-store
      deltafs show s3://bucket/run7 --version 812 --tensors --json
    """
    from deltafs.maintenance.inspect import show

    info = show(store, version, storage_options=parse_storage_options(storage_options))
    lines = [f"version {info.version} ({info.kind}{f', parent {info.parent}' if info.parent is not None else ''})"
             f"{' (HEAD)' if info.head else ''}, created {info.created.replace('T', ' ')[:19]} UTC",
             f"digest {info.digest}, chunk size {human_bytes(info.chunk_bytes)}"]
    if info.metadata:
        lines.append("metadata: " + " ".join(one_line(f"{k}={json.dumps(v) if not isinstance(v, str) else v}")
                                             for k, v in sorted(info.metadata.items())))
    lines.append(f"{len(info.files)} file(s), {len(info.tensors)} tensor(s), "
                 f"{human_bytes(sum(f.size for f in info.files))} in all, {human_bytes(info.stored)} stored by this version")
    for f in info.files:
        lines.append(f"  {one_line(f.path):<48} {human_bytes(f.size):>11}  stored {human_bytes(f.stored):>11}  {f.format}"
                     f"{f', {f.tensors} tensors' if f.tensors else ''}")
    if tensors:
        for t in info.tensors:
            codecs = ",".join(f"{k}x{v}" for k, v in sorted(t.codecs.items()))
            lines.append(f"  {one_line(t.name):<56} {t.dtype:<5} {str(list(t.shape)):<16} {human_bytes(t.nbytes):>11}  "
                         f"stored {human_bytes(t.stored):>11}  {codecs}")
    Output(json_mode=json_out).result(info.to_json(), "\n".join(lines))


def diff_cmd(
    store: Annotated[str, typer.Argument(help="Store URL.")],
    a: Annotated[int, typer.Argument(help="The older version.")],
    b: Annotated[int, typer.Argument(help="The newer version.")],
    tensor: Annotated[Optional[list[str]], typer.Option("--tensor", help="Only this tensor (repeatable).")] = None,
    all_tensors: Annotated[bool, typer.Option("--all", help="Also list tensors that did not change.")] = False,
    storage_options: StorageOptions = None,
    json_out: Json = False,
) -> None:
    """Per tensor: the fraction of elements that differ between versions A and B, and B's stored bytes.

    Examples:
      deltafs diff /mnt/ckpt-store 811 812
      deltafs diff s3://bucket/run7 800 812 --tensor lm_head.weight --json
    """
    from deltafs.maintenance.inspect import diff

    rows = diff(store, a, b, storage_options=parse_storage_options(storage_options), tensors=tensor)
    changed = sum(r.changed for r in rows)
    elements = sum(r.elements for r in rows)
    lines = [f"{'tensor':<56} {'status':<9} {'changed':>9} {'stored':>11}"]
    for r in rows:
        if r.status == "same" and not all_tensors and not tensor:
            continue
        lines.append(f"{r.name:<56} {r.status:<9} {r.fraction * 100:>8.3f}% {human_bytes(r.stored):>11}")
    lines.append(f"versions {a} -> {b}: {changed} of {elements} elements differ "
                 f"({changed / elements * 100 if elements else 0:.3f}%) in {sum(r.status != 'same' for r in rows)} of {len(rows)} tensors")
    data = {"a": a, "b": b, "changed": changed, "elements": elements, "tensors": [r.to_json() for r in rows]}
    Output(json_mode=json_out).result(data, "\n".join(lines))


def register(app: typer.Typer) -> None:
    app.command("show")(show_cmd)
    app.command("diff")(diff_cmd)
