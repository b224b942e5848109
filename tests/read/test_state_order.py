"""Ordering versions (cleanup, recycling) reads each DEST state record without parsing its embedded manifest."""

from __future__ import annotations

import json

import pytest

from deltafs.errors import FormatError
from deltafs.publish import push
from deltafs.read import dest as dest_mod
from deltafs.read.dest import LocalCheckpoint, _is_state, read_version_state
from deltafs.read.pull import pull


@pytest.fixture
def record(tmp_path, maker):
    store = str(tmp_path / "store")
    push(store, maker.write())
    pull(store, str(tmp_path / "dest"))
    path = LocalCheckpoint(str(tmp_path / "dest")).state().path
    with open(path + ".json", "rb") as fh:
        data = fh.read()
    return path, data


def _rewrite(path: str, data: bytes) -> None:
    with open(path + ".json", "wb") as fh:
        fh.write(data)
    dest_mod._STATE_MEMO.clear()


def test_a_record_as_written_counts_without_its_manifest_being_parsed(record, monkeypatch):
    path, data = record
    dest_mod._STATE_MEMO.clear()
    parsed: list[int] = []
    real = dest_mod.parse_dest_state
    monkeypatch.setattr(dest_mod, "parse_dest_state", lambda d: parsed.append(len(d)) or real(d))
    assert _is_state(path + ".json")
    assert len(parsed) == 1 and parsed[0] < len(data) // 4  # the record's own members only


def test_a_damaged_manifest_counts_for_ordering_but_is_never_served(record):
    path, data = record
    at = data.index(b'"files":[', data.index(b'"manifest":{'))
    _rewrite(path, data[:at] + b'"files":[}' + data[at + len(b'"files":['):])  # the manifest's JSON is broken
    assert _is_state(path + ".json")
    with pytest.raises(FormatError):
        read_version_state(path)


def test_records_the_guess_does_not_fit_are_parsed_whole(record):
    path, data = record
    spaced = json.dumps(json.loads(data), indent=1).encode()  # other spacing: still a record
    _rewrite(path, spaced)
    assert _is_state(path + ".json")
    raw = json.loads(data)
    raw["version"] = "2"  # a record's own member wrong
    _rewrite(path, json.dumps(raw, sort_keys=True, separators=(",", ":")).encode())
    assert not _is_state(path + ".json")
    _rewrite(path, data[: len(data) // 2])  # cut short
    assert not _is_state(path + ".json")


def test_a_record_past_the_size_bound_is_not_a_state(record):
    from deltafs.format.records import DEST_STATE_MAX_BYTES

    path, data = record
    at = data.index(b'"manifest":{') + len(b'"manifest":{')
    _rewrite(path, data[:at] + b" " * (DEST_STATE_MAX_BYTES + 1 - len(data)) + data[at:])  # valid JSON, too large
    assert not _is_state(path + ".json")


def test_the_version_dest_links_to_survives_cleanup_and_recycling_with_a_damaged_record(tmp_path, maker):
    store, dest = str(tmp_path / "store"), str(tmp_path / "dest")
    for _ in range(3):
        push(store, maker.write())
        pull(store, dest, keep=3)
        maker.advance()
    local = LocalCheckpoint(dest)
    current = local.state().path  # type: ignore[union-attr]
    with open(current + ".json", "rb") as fh:
        data = fh.read()
    at = data.index(b'"files":[', data.index(b'"manifest":{'))
    _rewrite(current, data[:at] + b'"files":[}' + data[at + len(b'"files":['):])  # its manifest no longer parses
    assert local.state() is None and _is_state(current + ".json")  # counted as a version, not served
    staging = local.recycle_as_staging(1, set())
    assert staging is not None and not staging.endswith(current.rsplit("/", 1)[1])  # an older one was taken
    local.cleanup(keep=0)
    import os

    assert os.path.isdir(current) and os.path.realpath(dest) == os.path.realpath(current)


def test_a_pull_names_the_damaged_record_of_the_version_dest_points_to(record, tmp_path, maker):
    from deltafs.errors import DestinationError

    path, data = record
    _rewrite(path, data[: len(data) // 2])
    maker.advance()
    store = str(tmp_path / "store")
    push(store, maker.write())
    with pytest.raises(DestinationError, match=r"points to .*, whose state record \(v\d{10}-[0-9a-f]{8}\.json\) is "
                                                r"missing or damaged; use --force"):
        pull(store, str(tmp_path / "dest"))
