"""Prometheus text-format metrics for the node_exporter textfile collector.

Set DELTAFS_METRICS_DIR (or pass metrics_dir) and push, pull and the watcher each keep one file
there (deltafs_push.prom, deltafs_pull.prom, deltafs_watch.prom), replaced atomically after every
run. Gauges hold the last run; `_total` counters add up across runs (read back from the file).
Series of other stores or destinations in the same file are kept.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Mapping

ENV_VAR = "DELTAFS_METRICS_DIR"

# name -> (type, help)
METRICS: dict[str, tuple[str, str]] = {
    "deltafs_push_last_version": ("gauge", "Version number of the last push."),
    "deltafs_push_last_bytes_written": ("gauge", "Bytes stored by the last push (chunks and manifest)."),
    "deltafs_push_last_full_bytes": ("gauge", "Bytes of the checkpoint the last push published."),
    "deltafs_push_last_seconds": ("gauge", "Wall time of the last push."),
    "deltafs_push_last_timestamp_seconds": ("gauge", "Unix time the last push finished."),
    "deltafs_push_total": ("counter", "Pushes completed."),
    "deltafs_push_bytes_written_total": ("counter", "Bytes stored by all pushes."),
    "deltafs_pull_last_version": ("gauge", "Version DEST holds after the last pull."),
    "deltafs_pull_last_bytes_read": ("gauge", "Bytes read from the store by the last pull."),
    "deltafs_pull_last_seconds": ("gauge", "Wall time of the last pull."),
    "deltafs_pull_last_timestamp_seconds": ("gauge", "Unix time the last pull finished."),
    "deltafs_pull_version_lag": ("gauge", "Store HEAD minus the version DEST holds, after the last pull."),
    "deltafs_pull_total": ("counter", "Pulls completed (updates and already-current runs)."),
    "deltafs_pull_bytes_read_total": ("counter", "Bytes read by all pulls."),
    "deltafs_watch_served_version": ("gauge", "Version the engine serves."),
    "deltafs_watch_version_lag": ("gauge", "Newest version seen in the store minus the served one."),
    "deltafs_watch_last_pause_seconds": ("gauge", "Engine pause of the last switch."),
    "deltafs_watch_last_sync_seconds": ("gauge", "Store-to-serving time of the last switch."),
    "deltafs_watch_switches_total": ("counter", "Engine switches completed."),
    "deltafs_watch_failures_total": ("counter", "Failed syncs (pull or switch)."),
}

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)$")


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    esc = {k: str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for k, v in labels.items()}
    return "{" + ",".join(f'{k}="{esc[k]}"' for k in sorted(esc)) + "}"


def _read(path: str) -> dict[tuple[str, str], float]:
    series: dict[tuple[str, str], float] = {}
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read(4 << 20)
    except OSError:
        return series
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m and not line.startswith("#"):
            try:
                series[(m.group(1), m.group(2) or "")] = float(m.group(3))
            except ValueError:
                continue
    return series


def record(job: str, labels: Mapping[str, str], gauges: Mapping[str, float], counters: Mapping[str, float],
           *, metrics_dir: str | None = None) -> str | None:
    """Update <dir>/deltafs_<job>.prom; returns its path, or None when no directory is configured."""
    directory = metrics_dir or os.environ.get(ENV_VAR)
    if not directory:
        return None
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"deltafs_{job}.prom")
    series = _read(path)
    label_text = _labels(labels)
    for name, value in gauges.items():
        series[(name, label_text)] = float(value)
    for name, inc in counters.items():
        series[(name, label_text)] = series.get((name, label_text), 0.0) + float(inc)
    lines: list[str] = []
    for name in sorted({n for n, _ in series}):
        kind, help_text = METRICS.get(name, ("gauge", name))
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for (n, lab), value in sorted(series.items()):
            if n == name:
                lines.append(f"{name}{lab} {value:.17g}")
    fd, tmp = tempfile.mkstemp(prefix=".deltafs_", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")
        os.replace(tmp, path)  # the collector never sees a half-written file
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def now() -> float:
    return time.time()
