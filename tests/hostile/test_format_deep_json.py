"""Deeply nested JSON in control files is a corrupt store (exit 5) with a message, never a RecursionError."""

from __future__ import annotations

import json
import os

import pytest

from deltafs.format.manifest import canonical_json, manifest_json, manifest_key, sha256_hex, stored_manifest
from deltafs.publish import push
from deltafs.testing.checkpoints import run_cli

DEEP = b"[" * 200_000 + b"]" * 200_000
SMALL_DEEP = b"[" * 2000 + b"]" * 2000  # within HEAD's size limit, deeper than Python's recursion limit


@pytest.fixture
def one_version(tmp_path, maker) -> str:
    url = str(tmp_path / "store")
    push(url, maker.write())
    return url


def _assert_corrupt(proc, *needles: str) -> None:
    assert proc.returncode == 5, (proc.returncode, proc.stdout, proc.stderr)
    assert "RecursionError" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)


@pytest.mark.parametrize("name", ["HEAD", "deltafs.json"])
def test_deep_control_file(tmp_path, one_version, name):
    with open(os.path.join(one_version, name), "wb") as fh:
        fh.write(SMALL_DEEP)
    _assert_corrupt(run_cli("pull", one_version, tmp_path / "dest"), "nested")


def test_deep_manifest_stored_compressed(tmp_path, one_version):
    with open(os.path.join(one_version, manifest_key(1)), "wb") as fh:
        fh.write(stored_manifest(DEEP))
    _assert_corrupt(run_cli("pull", one_version, tmp_path / "dest"), "version 1", "nested")


def test_manifest_with_deep_metadata_and_a_valid_digest(tmp_path, one_version):
    # A writer (buggy or hostile) can seal anything: the depth limit holds for well-formed manifests too.
    path = os.path.join(one_version, manifest_key(1))
    raw = json.loads(manifest_json(open(path, "rb").read()))
    deep: dict = {}
    node = deep
    for _ in range(100):
        node["x"] = {}
        node = node["x"]
    raw["metadata"] = {"deep": deep}
    raw.pop("digest")
    raw["digest"] = "sha256:" + sha256_hex(canonical_json(raw))
    with open(path, "wb") as fh:
        fh.write(stored_manifest(canonical_json(raw)))
    _assert_corrupt(run_cli("pull", one_version, tmp_path / "dest"), "version 1", "nested more than")


def test_deep_fleet_record_is_reported_not_fatal(one_version):
    os.makedirs(os.path.join(one_version, "fleet"))
    with open(os.path.join(one_version, "fleet", "host-a.json"), "wb") as fh:
        fh.write(DEEP)
    proc = run_cli("status", one_version)
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)  # "a host has a problem"
    assert "RecursionError" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    assert "host-a.json" in proc.stdout + proc.stderr
