"""show, diff, log --limit/--since and pull --dry-run through the real command line."""

from __future__ import annotations

import json
import os

from deltafs.testing.checkpoints import run_cli


def _store(tmp_path, maker, n=3):
    store = tmp_path / "store"
    for step in range(n):
        run_cli("push", maker.write(), store, "--meta", f"step={step * 100}", "-q", check=0)
        maker.advance()
    return store


def test_show_lists_files_tensors_and_metadata(tmp_path, maker):
    store = _store(tmp_path, maker, n=2)
    info = json.loads(run_cli("show", store, "--json", check=0).stdout)
    assert info["version"] == 2 and info["head"] and info["metadata"] == {"step": 100}
    assert {f["path"] for f in info["files"]} == {"config.json", "model.safetensors", "tokenizer/tokenizer.json"}
    lm = next(t for t in info["tensors"] if t["name"] == "lm_head.weight")
    assert lm["dtype"] == "BF16" and lm["shape"] == [64, 48] and lm["nbytes"] == 64 * 48 * 2
    human = run_cli("show", store, "--version", "1", "--tensors", check=0).stdout
    assert "version 1 (full)" in human and "lm_head.weight" in human and "UTC" in human
    assert run_cli("show", store, "--version", "9").returncode != 0


def test_diff_counts_changed_elements(tmp_path, maker):
    store = _store(tmp_path, maker, n=2)
    data = json.loads(run_cli("diff", store, "1", "2", "--json", check=0).stdout)
    by = {t["name"]: t for t in data["tensors"]}
    assert by["model.norm.weight"]["status"] == "same"  # the maker leaves it alone on odd steps
    assert 0 < by["lm_head.weight"]["fraction"] < 0.05
    assert data["changed"] == sum(t["changed"] for t in data["tensors"])
    one = json.loads(run_cli("diff", store, "1", "2", "--tensor", "lm_head.weight", "--json", check=0).stdout)
    assert [t["name"] for t in one["tensors"]] == ["lm_head.weight"]


def test_log_limit_since_and_metadata(tmp_path, maker):
    store = _store(tmp_path, maker, n=3)
    newest = json.loads(run_cli("log", store, "--limit", "1", "--json", check=0).stdout)["versions"]
    assert [v["version"] for v in newest] == [3]
    since = json.loads(run_cli("log", store, "--since", "2", "--json", check=0).stdout)["versions"]
    assert [v["version"] for v in since] == [2, 3]
    assert json.loads(run_cli("log", store, "--since", "2999-01-01", "--json", check=0).stdout)["versions"] == []
    for prefix in ("2000-01", "2000-01-01 08:00", "2000-01-01T08:00:00Z"):  # digits alone are a version
        out = json.loads(run_cli("log", store, "--since", prefix, "--json", check=0).stdout)["versions"]
        assert [v["version"] for v in out] == [1, 2, 3], prefix
    # What matches nothing by accident (a typo, a month 13) or everything (a negative number) is refused, exit 2,
    # before the store is read.
    for bad in ("garbage", "2026-13-45", "2026-02-30", "-3", "2026-12-01T25:00", "12-01"):
        proc = run_cli("log", tmp_path / "no-store", "--since", bad)
        assert proc.returncode == 2 and "--since must be a version number or a UTC time" in proc.stderr, (bad, proc.stderr)
    human = run_cli("log", store, check=0).stdout
    assert "created (UTC)" in human and "step=200" in human


def test_pull_dry_run_changes_nothing(tmp_path, maker):
    store = _store(tmp_path, maker, n=2)
    dest = tmp_path / "dest"
    plan = json.loads(run_cli("pull", store, dest, "--dry-run", "--json", check=0).stdout)
    assert plan["version"] == 2 and plan["objects"] > 0 and not plan["up_to_date"]
    assert not os.path.lexists(dest) and not os.path.lexists(str(dest) + ".deltafs")
    run_cli("pull", store, dest, "-q", check=0)
    again = json.loads(run_cli("pull", store, dest, "--dry-run", "--json", check=0).stdout)
    assert again["up_to_date"] and again["objects"] == 0
