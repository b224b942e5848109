"""Prometheus textfile metrics written by push and pull through the real command line."""

from __future__ import annotations

import os
import re

from deltafs import metrics
from deltafs.testing.checkpoints import run_cli


def _parse(path):
    out = {}
    for line in open(path).read().splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^(\w+)(\{.*\})? (\S+)$", line)
        assert m, f"not Prometheus text format: {line!r}"
        out[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return out


def test_push_and_pull_write_textfile_metrics(tmp_path, maker):
    mdir, store, dest = tmp_path / "metrics", tmp_path / "store", tmp_path / "dest"
    env = {"DELTAFS_METRICS_DIR": str(mdir)}
    run_cli("push", maker.write(), store, "-q", env=env, check=0)
    maker.advance()
    run_cli("push", maker.write(), store, "-q", env=env, check=0)
    push = _parse(mdir / "deltafs_push.prom")
    label = f'{{store="{store}"}}'
    assert push[("deltafs_push_total", label)] == 2 and push[("deltafs_push_last_version", label)] == 2
    assert push[("deltafs_push_bytes_written_total", label)] > push[("deltafs_push_last_bytes_written", label)] > 0
    run_cli("pull", store, dest, "--version", "1", "-q", env=env, check=0)
    pull = _parse(mdir / "deltafs_pull.prom")
    plabel = f'{{dest="{os.path.abspath(dest)}",store="{store}"}}'
    assert pull[("deltafs_pull_last_version", plabel)] == 1 and pull[("deltafs_pull_version_lag", plabel)] == 1
    run_cli("pull", store, dest, "-q", env=env, check=0)
    pull = _parse(mdir / "deltafs_pull.prom")
    assert pull[("deltafs_pull_version_lag", plabel)] == 0 and pull[("deltafs_pull_total", plabel)] == 2
    text = (mdir / "deltafs_pull.prom").read_text()
    assert "# TYPE deltafs_pull_total counter" in text and "# HELP deltafs_pull_last_seconds" in text
    assert not [n for n in os.listdir(mdir) if n.endswith(".tmp")]


def test_series_of_other_stores_are_kept_and_labels_escaped(tmp_path):
    metrics.record("push", {"store": 's3://b/"x"'}, {"deltafs_push_last_version": 3}, {"deltafs_push_total": 1},
                   metrics_dir=str(tmp_path))
    metrics.record("push", {"store": "/other"}, {"deltafs_push_last_version": 7}, {"deltafs_push_total": 1},
                   metrics_dir=str(tmp_path))
    series = _parse(tmp_path / "deltafs_push.prom")
    assert series[("deltafs_push_last_version", '{store="s3://b/\\"x\\""}')] == 3
    assert series[("deltafs_push_last_version", '{store="/other"}')] == 7


def test_nothing_is_written_without_a_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("DELTAFS_METRICS_DIR", raising=False)
    assert metrics.record("push", {}, {"deltafs_push_last_version": 1}, {}) is None
