"""Store control files that are not what they claim: FIFOs, devices, links, oversized. Clean exit 5, never a hang or an OOM."""

from __future__ import annotations

import os
import stat

import pytest

from deltafs.publish import push
from deltafs.testing.checkpoints import run_cli

from .conftest import deltafs, one_line


@pytest.fixture
def two_versions(tmp_path, maker) -> str:
    url = str(tmp_path / "store")
    push(url, maker.write())
    maker.advance()
    push(url, maker.write())
    return url


def _replace(path: str, make) -> None:
    os.unlink(path)
    make(path)


def _assert_corrupt(proc, *needles: str) -> None:
    assert proc.returncode == 5, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)


def test_fifo_as_head_fails_at_once(tmp_path, two_versions):
    _replace(os.path.join(two_versions, "HEAD"), os.mkfifo)
    # A reader that opened the FIFO would block forever: run_cli's timeout turns that into a failure.
    _assert_corrupt(run_cli("pull", two_versions, tmp_path / "dest", timeout=120), "HEAD", "not a regular file")
    _assert_corrupt(run_cli("log", two_versions, timeout=120), "HEAD", "not a regular file")
    assert not os.path.lexists(tmp_path / "dest")


def test_fifo_as_manifest_fails_at_once(tmp_path, two_versions):
    _replace(os.path.join(two_versions, "manifests", "v0000000002.json"), os.mkfifo)
    _assert_corrupt(run_cli("pull", two_versions, tmp_path / "dest", "--version", "2", timeout=120),
                    "v0000000002.json", "not a regular file")


@pytest.mark.skipif(os.geteuid() != 0, reason="making a character device needs root")
def test_dev_zero_as_head_is_refused_without_reading_it(tmp_path, two_versions):
    head = os.path.join(two_versions, "HEAD")
    _replace(head, lambda p: os.mknod(p, stat.S_IFCHR | 0o600, os.makedev(1, 5)))  # what /dev/zero is
    _assert_corrupt(run_cli("pull", two_versions, tmp_path / "dest", timeout=120), "HEAD", "not a regular file")


def test_symlink_as_head_is_not_followed(tmp_path, two_versions):
    _replace(os.path.join(two_versions, "HEAD"), lambda p: os.symlink("/dev/zero", p))
    _assert_corrupt(run_cli("pull", two_versions, tmp_path / "dest", timeout=120), "HEAD", "symbolic link")


def test_oversized_head_and_config_are_refused(tmp_path, two_versions):
    head = os.path.join(two_versions, "HEAD")
    valid = open(head, "rb").read()
    with open(head, "wb") as fh:
        fh.write(b" " * (8 << 20) + valid)  # valid JSON after 8 MiB of blanks: no HEAD is that large
    _assert_corrupt(run_cli("pull", two_versions, tmp_path / "dest", timeout=120), "HEAD", "larger than")
    with open(head, "wb") as fh:
        fh.write(valid)
    config = os.path.join(two_versions, "deltafs.json")
    data = open(config, "rb").read()
    with open(config, "wb") as fh:
        fh.write(data + b" " * (1 << 20))
    _assert_corrupt(run_cli("log", two_versions, timeout=120), "deltafs.json", "larger than")


def test_a_push_does_not_claim_a_prefix_that_holds_a_foreign_head(tmp_path, maker):
    """A prefix with a HEAD but no deltafs.json (another tool's, or a store whose config was deleted): the push
    refused it only after writing deltafs.json there, which made gc call it an empty store. Now nothing is written."""
    store = tmp_path / "other"
    store.mkdir()
    (store / "HEAD").write_text("ref: refs/heads/main\n")
    one_line(deltafs("push", maker.write(), store), 5, "holds a HEAD but no deltafs.json")
    assert sorted(os.listdir(store)) == ["HEAD"]


def test_a_malformed_head_names_the_store_and_the_field(tmp_path, store):
    with open(os.path.join(store, "HEAD"), "w") as fh:
        fh.write('{"format": "deltafs.head", "format_version": 1, "version": 2, "digest": "sha256:xyz"}')
    line = one_line(deltafs("pull", store, tmp_path / "dest"), 5, "HEAD is malformed: digest", store)
    assert "sha256:xyz" in line
