"""A manifest this process has checked is not checked again, and nothing else is taken for it."""

from __future__ import annotations

import pytest

from deltafs.errors import FormatError
from deltafs.format.manifest import Manifest
from deltafs.publish import push
from deltafs.store.repo import Repository
from deltafs.testing.checkpoints import write_safetensors


def _stored_manifest(tmp_path) -> bytes:
    src = tmp_path / "src"
    src.mkdir()
    write_safetensors(str(src / "model.safetensors"), {"w": ("BF16", (4096,), bytes(range(256)) * 32)})
    store = str(tmp_path / "store")
    push(store, str(src))
    return Repository.open(store).manifest(1).to_bytes()


def test_the_same_bytes_give_the_manifest_already_checked(tmp_path):
    data = _stored_manifest(tmp_path)
    first = Manifest.from_bytes(data)
    assert Manifest.from_bytes(bytes(data)) is first


def test_bytes_that_differ_from_a_checked_manifest_are_checked_in_full(tmp_path):
    data = _stored_manifest(tmp_path)
    Manifest.from_bytes(data)
    at = data.index(b'"created":"') + len(b'"created":"')
    edited = data[:at] + (b"1" if data[at:at + 1] != b"1" else b"2") + data[at + 1:]
    with pytest.raises(FormatError, match="digest field does not match"):
        Manifest.from_bytes(edited)
    # Reformatted but equal JSON is not the checked bytes either: parsed and checked, and it is still valid.
    spaced = data.replace(b'"version":', b'"version": ', 1)
    again = Manifest.from_bytes(spaced)
    assert again.digest == Manifest.from_bytes(data).digest


def test_a_manifest_is_found_embedded_only_verbatim_and_under_its_own_digest(tmp_path):
    data = _stored_manifest(tmp_path)
    man = Manifest.from_bytes(data)
    record = b'{"digest":"x","manifest":' + data + b',"version":1}'
    assert Manifest.embedded_in(record, man.digest) is man
    assert Manifest.embedded_in(record, "sha256:" + "0" * 64) is None
    assert Manifest.embedded_in(record, None) is None
    assert Manifest.embedded_in(record.replace(b'"version":', b'"version": '), man.digest) is None


def test_a_manifest_built_here_is_checked_before_it_counts_as_known(tmp_path):
    from dataclasses import replace

    data = _stored_manifest(tmp_path)
    built = replace(Manifest.from_bytes(data), metadata={"step": 7}).seal()  # what a push builds: sealed, new
    assert built.checked() is built
    assert Manifest.from_bytes(built.to_bytes()) is built
    with pytest.raises(FormatError, match="digest field does not match"):
        replace(built, metadata={"step": 8}).checked()  # not resealed: its digest is the other body's
    with pytest.raises(FormatError, match="parent and parent_digest"):
        replace(built, parent=None, parent_digest="sha256:" + "0" * 64).seal().checked()
