"""10.8: HEAD is checked against the manifests; verify, pull and push say what is wrong with it."""

from __future__ import annotations

import os

from deltafs.format.manifest import Head

from .conftest import deltafs, one_line


def _write_head(store: str, head: Head) -> None:
    with open(os.path.join(store, "HEAD"), "wb") as fh:
        fh.write(head.to_bytes())


def test_head_naming_a_missing_version(tmp_path, store, maker):
    _write_head(store, Head(7, "sha256:" + "0" * 64))
    proc = deltafs("verify", store, "--all")
    assert proc.returncode == 6 and "HEAD names version 7, which is not in the store" in proc.stdout
    one_line(deltafs("pull", store, tmp_path / "dest"), 4, "HEAD", "version 7")
    maker.advance()
    one_line(deltafs("push", maker.write(), store), 4, "HEAD", "version 7")


def test_head_whose_digest_matches_no_manifest(tmp_path, store):
    _write_head(store, Head(1, "sha256:" + "ab" * 32))
    proc = deltafs("verify", store)
    assert proc.returncode == 6 and "HEAD names version 1 with digest sha256:" + "ab" * 32 in proc.stdout
    one_line(deltafs("pull", store, tmp_path / "dest"), 5, "HEAD", "digest")
    assert not os.path.lexists(tmp_path / "dest")


def test_verify_of_a_version_that_does_not_exist_is_exit_4(store):
    """As show, diff and pull say it (the README's exit code for a version that is not in the store); a version
    that exists and fails its checks stays exit 6."""
    one_line(deltafs("verify", store, "--version", "99"), 4, "version 99 is not in")
    one_line(deltafs("show", store, "--version", "99"), 4, "version 99 is not in")
    assert deltafs("verify", store, "--version", "1").returncode == 0
