"""Corruption anywhere is detected and named; DEST never changes to something unverified."""

from __future__ import annotations

import glob
import json
import os

import pytest
import zstandard

from deltafs.errors import FormatError, IntegrityError, DestinationError
from deltafs.format.manifest import chunk_key, manifest_json, manifest_key, stored_manifest
from deltafs.maintenance.verify import verify
from deltafs.publish import push
from deltafs.read.pull import local_version, pull
from deltafs.store.repo import Repository
from deltafs.testing.checkpoints import files_of


def _two_versions(tmp_path, maker):
    store = str(tmp_path / "store")
    push(store, maker.write())
    maker.advance()
    push(store, maker.write())
    return store


def _delta_chunk_paths(store: str, version: int) -> list[str]:
    man = Repository.open(store).manifest(version)
    return [os.path.join(store, chunk_key(c.object)) for f in man.files for s in f.segments for c in s.chunks
            if c.object and s.kind == "tensor"]


def test_corrupt_chunk_is_named_and_dest_keeps_old_version(tmp_path, maker):
    store = _two_versions(tmp_path, maker)
    dest = str(tmp_path / "dest")
    pull(store, dest, version=1)
    before = files_of(dest)
    victim = _delta_chunk_paths(store, 2)[0]
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2] ^= 0x40
    open(victim, "wb").write(bytes(data))
    with pytest.raises(IntegrityError) as err:
        pull(store, dest)
    assert os.path.basename(victim) in str(err.value)
    # README: "naming version, file, tensor and chunk" (it named the object only; review of the docs).
    man = Repository.open(store).manifest(2)
    owners = [f"version 2: {f.path}: tensor {s.key[2:]}, chunk {i}: " for f in man.files for s in f.segments
              for i, c in enumerate(s.chunks) if c.object == os.path.basename(victim)]
    assert any(str(err.value).startswith(o) for o in owners), (str(err.value), owners)
    assert files_of(dest) == before and local_version(dest).version == 1
    rep = verify(store, version=2)
    assert not rep.ok and any(os.path.basename(victim) in p for p in rep.problems)


def test_missing_chunk_fails_cleanly(tmp_path, maker):
    store = _two_versions(tmp_path, maker)
    os.unlink(_delta_chunk_paths(store, 2)[0])
    rep = verify(store, all_versions=True)
    assert not rep.ok and any("version 2" in p and "missing" in p for p in rep.problems)
    with pytest.raises(Exception, match=r"^version 2: .+: tensor .+, chunk \d+: object .+ is missing"):
        pull(store, str(tmp_path / "dest"))
    assert not os.path.lexists(tmp_path / "dest")


def test_edited_manifest_is_refused(tmp_path, maker):
    store = _two_versions(tmp_path, maker)
    path = os.path.join(store, manifest_key(2))
    raw = json.loads(manifest_json(open(path, "rb").read()))
    raw["files"][0]["size"] += 1
    open(path, "wb").write(stored_manifest(json.dumps(raw).encode()))
    with pytest.raises(FormatError, match="version 2"):
        pull(store, str(tmp_path / "dest"))
    assert not verify(store, all_versions=True).ok


def test_unknown_format_version_is_refused(tmp_path, maker):
    store = _two_versions(tmp_path, maker)
    path = os.path.join(store, manifest_key(2))
    raw = json.loads(manifest_json(open(path, "rb").read()))
    raw["format_version"] = 99
    open(path, "wb").write(stored_manifest(json.dumps(raw).encode()))
    with pytest.raises(FormatError, match="unknown manifest format version 99"):
        Repository.open(store).manifest(2)


def test_garbage_manifest_is_refused(tmp_path, maker):
    store = _two_versions(tmp_path, maker)
    open(os.path.join(store, manifest_key(2)), "wb").write(b"\x00garbage")
    with pytest.raises(FormatError, match="not valid JSON"):
        pull(store, str(tmp_path / "dest"))


def _forge(store: str, version: int, edit) -> None:
    """Rewrite a manifest with a valid self-digest, as a buggy or malicious writer could."""
    repo = Repository.open(store)
    path = os.path.join(store, manifest_key(version))
    raw = json.loads(manifest_json(open(path, "rb").read()))
    edit(raw)
    raw.pop("digest")
    from deltafs.format.manifest import canonical_json, sha256_hex

    raw["digest"] = "sha256:" + sha256_hex(canonical_json(raw))
    open(path, "wb").write(stored_manifest(canonical_json(raw)))
    repo._manifests.clear()


def test_path_escaping_dest_is_refused(tmp_path, maker):
    store = _two_versions(tmp_path, maker)

    def evil(raw):
        raw["files"][0]["path"] = "../../escaped.json"

    _forge(store, 1, evil)
    with pytest.raises(FormatError, match="unsafe file path"):
        pull(store, str(tmp_path / "dest"), version=1)
    assert not glob.glob(str(tmp_path / "**" / "escaped.json"), recursive=True)


def test_absolute_path_is_refused(tmp_path, maker):
    store = _two_versions(tmp_path, maker)
    _forge(store, 1, lambda raw: raw["files"][0].__setitem__("path", "/etc/passwd"))
    with pytest.raises(FormatError, match="unsafe file path"):
        Repository.open(store).manifest(1)


def test_zstd_bomb_is_refused(tmp_path, maker):
    store = _two_versions(tmp_path, maker)
    repo = Repository.open(store)
    bomb = zstandard.ZstdCompressor(level=19).compress(b"\0" * (64 << 20))
    oid, _ = repo.put_chunk(bomb)

    def swap(raw):
        for f in raw["files"]:
            for s in f["segments"]:
                if s["kind"] == "tensor" and s["chunks"]:
                    s["chunks"][0].update(object=oid, stored=len(bomb), codec={"name": "raw", "planes": 1})
                    return

    _forge(store, 1, swap)
    with pytest.raises(IntegrityError):
        pull(store, str(tmp_path / "dest"), version=1)
    assert not os.path.lexists(tmp_path / "dest")


def test_corrupt_local_file_detected_by_verify_local(tmp_path, maker):
    store = _two_versions(tmp_path, maker)
    dest = str(tmp_path / "dest")
    pull(store, dest)
    target = os.path.join(dest, "model.safetensors")
    data = bytearray(open(target, "rb").read())
    data[-3] ^= 1
    open(target, "wb").write(bytes(data))
    rep = verify(store, local=dest)
    assert not rep.ok and "model.safetensors" in rep.problems[0]


def test_corrupt_local_base_falls_back_to_full_version(tmp_path, maker):
    store = _two_versions(tmp_path, maker)
    dest = str(tmp_path / "dest")
    pull(store, dest, version=1)
    target = os.path.join(dest, "model.safetensors")
    data = bytearray(open(target, "rb").read())
    data[-3] ^= 1
    open(target, "wb").write(bytes(data))
    res = pull(store, dest)
    assert res.fallback and res.from_full and res.version == 2
    assert verify(store, local=dest).ok


def test_dest_of_another_store_is_refused_unless_forced(tmp_path, maker):
    a = _two_versions(tmp_path, maker)
    b = str(tmp_path / "other")
    push(b, maker.write("other-src"))
    dest = str(tmp_path / "dest")
    pull(a, dest)
    with pytest.raises(DestinationError, match="another store"):
        pull(b, dest)
    assert local_version(dest).store_url == a
    pull(b, dest, force=True)
    assert local_version(dest).store_url == b


def test_foreign_directory_is_moved_aside_only_with_force(tmp_path, maker):
    store = _two_versions(tmp_path, maker)
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "precious.txt").write_text("mine")
    with pytest.raises(DestinationError):
        pull(store, str(dest))
    assert (dest / "precious.txt").read_text() == "mine"
    pull(store, str(dest), force=True)
    kept = glob.glob(str(tmp_path / "dest.deltafs" / "displaced-*" / "precious.txt"))
    assert len(kept) == 1 and open(kept[0]).read() == "mine"


def test_a_state_file_edited_in_place_is_read_again_even_with_its_old_mtime(tmp_path, maker):
    from deltafs.read.dest import LocalCheckpoint, read_version_state

    store = _two_versions(tmp_path, maker)
    dest = str(tmp_path / "dest")
    pull(store, dest)
    state = LocalCheckpoint(dest).state()
    path = state.path + ".json"
    assert read_version_state(state.path)[1]["store_url"] == state.store_url  # parsed, and remembered
    st = os.stat(path)
    with open(path, "rb") as fh:
        data = bytearray(fh.read())
    at = data.index(b'"store_url":"') + len(b'"store_url":"')
    data[at:at + 1] = b"X"  # same size, same mtime below: only ctime tells
    with open(path, "r+b") as fh:
        fh.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns
    assert read_version_state(state.path)[1]["store_url"].startswith("X")


def test_a_state_file_whose_embedded_manifest_was_edited_is_refused_though_the_manifest_was_checked_before(
        tmp_path, maker):
    """The process has checked this version's manifest (pull just did); an edit inside the copy a state file
    embeds, with the digest field left as it was, is still caught: only a verbatim copy is taken as known."""
    from deltafs.errors import FormatError
    from deltafs.read.dest import LocalCheckpoint, read_version_state

    store = _two_versions(tmp_path, maker)
    dest = str(tmp_path / "dest")
    pull(store, dest)
    state = LocalCheckpoint(dest).state()
    path = state.path + ".json"
    assert read_version_state(state.path)[0].digest == state.digest
    with open(path, "rb") as fh:
        data = bytearray(fh.read())
    at = data.index(b'"created":"') + len(b'"created":"')  # inside the embedded manifest, not under its digest
    data[at:at + 1] = b"1" if data[at:at + 1] != b"1" else b"2"
    with open(path, "wb") as fh:
        fh.write(data)
    with pytest.raises(FormatError, match="digest field does not match"):
        read_version_state(state.path)


def test_the_state_file_a_pull_just_wrote_is_not_parsed_again_until_it_changes(tmp_path, maker, monkeypatch):
    # At 70B the state record holds a 10 MB manifest: parsing it back right after writing it cost ~0.4 s per pull.
    import re

    from deltafs.read import dest as dest_mod
    from deltafs.read.dest import LocalCheckpoint

    store = str(tmp_path / "store")
    dest = str(tmp_path / "dest")
    push(store, maker.write())
    pull(store, dest)
    maker.advance()
    push(store, maker.write())
    parsed = []
    real = dest_mod.parse_dest_state
    monkeypatch.setattr(dest_mod, "parse_dest_state",
                        lambda data: parsed.append(int(re.findall(rb'"version":(\d+)}', data)[-1])) or real(data))
    pull(store, dest)  # installs version 2, then reads its state (cleanup, the result) without parsing it
    assert 2 not in parsed
    state = LocalCheckpoint(dest).state()
    assert state is not None and state.version == 2 and state.files and 2 not in parsed
    os.utime(state.path + ".json")  # any change to the file moves its ctime: read again
    again = LocalCheckpoint(dest).state()
    assert parsed.count(2) == 1 and again is not None and again.digest == state.digest and again.files == state.files


def test_a_state_file_with_a_second_manifest_member_is_checked_on_the_member_json_keeps(tmp_path, maker):
    """json.loads keeps the last of duplicate keys: a genuine manifest's text first and an edited copy after it
    (same digest field, other spacing) must not pass as the genuine one, nor replace it in the process's memory."""
    import json

    from deltafs.errors import FormatError
    from deltafs.format.manifest import Manifest
    from deltafs.read import dest as dest_mod
    from deltafs.read.dest import LocalCheckpoint, read_version_state

    store = _two_versions(tmp_path, maker)
    dest = str(tmp_path / "dest")
    pull(store, dest)
    state = LocalCheckpoint(dest).state()
    path = state.path + ".json"
    with open(path, "rb") as fh:
        data = fh.read()
    edited = json.loads(state.manifest.to_bytes())
    edited["store_id"] = "f" * 32
    with open(path, "wb") as fh:
        fh.write(data[:-1] + b',"manifest": ' + json.dumps(edited).encode() + b"}")
    dest_mod._STATE_MEMO.clear()
    with pytest.raises(FormatError, match="digest field does not match"):
        read_version_state(state.path)
    genuine = Repository.open(store).manifest(2)
    assert genuine.store_id == state.store_id and Manifest.known(genuine.to_bytes()).store_id == state.store_id


def test_a_pull_that_keeps_one_version_leaves_no_state_file_of_the_one_it_removed(tmp_path, maker):
    store = str(tmp_path / "store")
    dest = str(tmp_path / "dest")
    for _ in range(3):
        push(store, maker.write())
        pull(store, dest, keep=1)
        maker.advance()
    sidecar = dest + ".deltafs"
    versions = sorted(n for n in os.listdir(sidecar) if n.startswith("v") and not n.endswith(".json"))
    states = sorted(n[:-5] for n in os.listdir(sidecar) if n.startswith("v") and n.endswith(".json"))
    assert len(versions) == 1 and states == versions


def test_an_unknown_codec_record_is_a_format_error_naming_where_it_is(tmp_path, maker):
    """FORMAT.md: a reader MUST refuse (format error) an unknown codec name or a bad field; pull said "cannot be
    decoded", an integrity error (exit 6), as for a damaged payload (hostile-store pass)."""
    from deltafs.testing.checkpoints import run_cli

    store = _two_versions(tmp_path, maker)

    def bogus(raw):
        seg = next(s for f in raw["files"] for s in f["segments"] if s["kind"] == "tensor")
        seg["chunks"][0]["codec"] = {"name": "bogus"}

    _forge(store, 2, bogus)
    with pytest.raises(FormatError, match=r"^version 2: .+: tensor .+, chunk 0: bad codec record: .*bogus"):
        pull(store, str(tmp_path / "dest"), version=2)
    cli = run_cli("pull", store, str(tmp_path / "dest2"), "--version", "2")
    assert cli.returncode == 5 and "bad codec record" in cli.stderr, cli.stderr


def test_a_file_unreadable_during_the_full_check_is_reported_as_changed(tmp_path, maker, monkeypatch):
    """The watcher's full pre-switch check (check_files(full=True)) let an OSError out (a file removed between its
    lstat and its read, EIO): apply() retried the same version forever instead of staging it again (review)."""
    import errno

    from deltafs.read import dest as dest_module
    from deltafs.read.dest import LocalCheckpoint

    store = _two_versions(tmp_path, maker)
    dest = str(tmp_path / "dest")
    pull(store, dest)
    local = LocalCheckpoint(dest)

    def eio(*a, **k):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(dest_module, "file_digest_on_disk", eio)
    changed = local.check_files(local.state(), full=True)
    assert changed is not None and "cannot be read: Input/output error" in changed


def test_a_record_that_lies_about_an_object_fetched_under_another_record_fails_pull_as_verify(tmp_path, maker):
    """Versions 2 and 3 name the same object; version 3's record says it is 5 bytes longer than it is. A cold pull
    of version 3 fetched it once, under version 2's record: pull installed the version (exit 0) while verify said
    exit 6 (hostile-store pass). A record's claim is checked when the object comes from memory too."""
    store = _two_versions(tmp_path, maker)
    maker.advance()
    push(store, maker.write())
    repo = Repository.open(store)
    in_v2 = {c.object for f in repo.manifest(2).files for s in f.segments for c in s.chunks if c.object}
    shared = [(fi, si, ci) for fi, f in enumerate(repo.manifest(3).files) for si, s in enumerate(f.segments)
              for ci, c in enumerate(s.chunks) if c.object in in_v2 and c.pack is None]
    if not shared:
        pytest.skip("versions 2 and 3 share no unpacked object here")
    fi, si, ci = shared[0]

    def lie(raw):
        raw["files"][fi]["segments"][si]["chunks"][ci]["stored"] += 5

    _forge(store, 3, lie)
    with pytest.raises(IntegrityError, match="manifest says"):
        pull(store, str(tmp_path / "dest"), version=3)
    assert not verify(store, version=3).ok
