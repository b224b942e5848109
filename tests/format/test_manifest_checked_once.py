"""A manifest this process has checked is not checked again, and nothing else is taken for it."""

from __future__ import annotations

import json

import pytest

from deltafs.errors import FormatError
from deltafs.format.manifest import Manifest, manifest_json
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


def test_a_manifest_is_known_only_by_its_exact_canonical_json(tmp_path):
    data = _stored_manifest(tmp_path)
    man = Manifest.from_bytes(data)
    assert Manifest.known(data) is man
    assert Manifest.known(data.replace(b'"version":', b'"version": ')) is None
    assert Manifest.known(data[:-1]) is None


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


def _forget_checked() -> None:
    from deltafs.format import manifest as mod

    with mod._CHECKED_LOCK:
        mod._CHECKED.clear()


def test_a_canonical_manifest_is_checked_without_encoding_it_again(tmp_path, monkeypatch):
    """The stored JSON of a manifest, less its digest member, is the body's canonical JSON: its hash is checked
    directly, and the stored bytes are what to_bytes() gives back (no encode for the digest or the install)."""
    from deltafs.format import manifest as mod

    data = _stored_manifest(tmp_path)
    _forget_checked()
    calls = []
    real = mod.canonical_json
    monkeypatch.setattr(mod, "canonical_json", lambda obj: calls.append(1) or real(obj))
    man = Manifest.from_bytes(data)
    assert calls == [] and man.to_bytes() == data
    # JSON written another way (a space, members in another order) is checked by encoding its body.
    _forget_checked()
    spaced = Manifest.from_bytes(data.replace(b'"version":', b'"version": ', 1))
    assert calls and spaced.digest == man.digest and spaced.to_bytes() == data
    _forget_checked()
    calls.clear()
    member = b',"digest":"' + man.digest.encode() + b'"'
    moved = data.replace(member, b"", 1)[:-1] + member + b"}"
    assert Manifest.from_bytes(moved).digest == man.digest and calls


@pytest.mark.parametrize("edit", ["chunk size", "object id", "version", "a duplicate key after the digest"])
def test_an_edit_anywhere_in_a_canonical_manifest_is_refused(tmp_path, edit):
    data = _stored_manifest(tmp_path)
    _forget_checked()
    if edit == "chunk size":
        edited = data.replace(b'"size":8192', b'"size":8190', 1)
    elif edit == "object id":
        at = data.index(b'"object":"') + len(b'"object":"')
        edited = data[:at] + (b"0" if data[at:at + 1] != b"0" else b"1") + data[at + 1:]
    elif edit == "version":
        edited = data.replace(b'"version":1}', b'"version":2}')
    else:
        edited = data[:-1] + b',"kind":"delta"}'  # JSON keeps the last of duplicate keys
    assert edited != data
    with pytest.raises(FormatError):
        Manifest.from_bytes(edited)


def test_checked_encodes_the_fields_as_they_are_now_not_an_earlier_to_bytes(tmp_path):
    from dataclasses import replace

    data = _stored_manifest(tmp_path)
    built = replace(Manifest.from_bytes(data), metadata={"step": 7}).seal()
    built.to_bytes()
    built.metadata["step"] = 8  # changed in place after its JSON was taken: the digest no longer fits
    with pytest.raises(FormatError, match="digest field does not match"):
        built.checked()


@pytest.mark.parametrize("where", ["first", "last"])
def test_a_member_the_format_does_not_define_is_refused_not_dropped(tmp_path, where):
    # Outside the digest, an extra member would pass unchecked; the JSON Schema refuses it too.
    data = _stored_manifest(tmp_path)
    _forget_checked()
    edited = b'{"comment":"x",' + data[1:] if where == "first" else data[:-1] + b',"zz":1}'
    with pytest.raises(FormatError, match="unknown top-level member"):
        Manifest.from_bytes(edited)


def _state_of(man: Manifest) -> bytes:
    from deltafs.format.records import dest_state_bytes, dest_state_record

    record = dest_state_record(store_id=man.store_id, store_url="file:///store", version=man.version,
                               digest=man.digest, files={"model.safetensors": [1, 2]})
    return dest_state_bytes(record, man.to_bytes())


def test_a_state_record_embeds_the_manifest_as_canonical_json_of_the_parsed_record_would(tmp_path, monkeypatch):
    import json

    from deltafs.format import records

    monkeypatch.setattr(records, "utcnow", lambda: "2026-12-01T00:00:00.000000Z")
    man = Manifest.from_bytes(_stored_manifest(tmp_path))
    state = _state_of(man)
    assert state == records.canonical_json(json.loads(state))
    assert json.loads(state)["manifest"] == json.loads(man.to_bytes())


@pytest.mark.parametrize("metadata", [{}, {"store_id": "x", "manifest": {"a": 1}, "note": '"manifest":{'}])
def test_a_state_record_is_read_without_encoding_its_manifest_again(tmp_path, monkeypatch, metadata):
    from dataclasses import replace

    from deltafs.format import manifest as mod
    from deltafs.read import dest

    man = replace(Manifest.from_bytes(_stored_manifest(tmp_path)), metadata=metadata).seal().checked()
    vdir = str(tmp_path / "v0000000001-00000000")
    with open(vdir + ".json", "wb") as fh:
        fh.write(_state_of(man))
    _forget_checked()
    dest._STATE_MEMO.clear()
    calls = []
    real = mod.canonical_json
    monkeypatch.setattr(mod, "canonical_json", lambda obj: calls.append(1) or real(obj))
    read, raw = dest.read_version_state(vdir)
    assert calls == [] and read.digest == man.digest and read.to_bytes() == man.to_bytes()
    assert raw["store_url"] == "file:///store"


@pytest.mark.parametrize("metadata", [{}, {"files": ',"files":[', "digest": "x"}])
def test_sealed_is_seal_then_checked_in_one_encode(tmp_path, monkeypatch, metadata):
    from dataclasses import replace

    from deltafs.format import manifest as mod

    unsealed = replace(Manifest.from_bytes(_stored_manifest(tmp_path)), metadata=metadata, digest="")
    reference = unsealed.seal().checked()
    _forget_checked()
    calls = []
    real = mod.canonical_json
    monkeypatch.setattr(mod, "canonical_json", lambda obj: calls.append(1) or real(obj))
    sealed = unsealed.sealed()
    assert len(calls) == 1
    assert sealed.digest == reference.digest and sealed.to_bytes() == reference.to_bytes()
    assert Manifest.from_bytes(sealed.to_bytes()) is sealed  # remembered as checked
    with pytest.raises(FormatError, match="parent and parent_digest"):
        replace(unsealed, parent=None, parent_digest="sha256:" + "0" * 64).sealed()


@pytest.mark.parametrize("record, edit", [("chunk", (b'"stored":', b'"zz":1,"stored":')),
                                          ("segment", (b'"offset":', b'"note":"x","offset":')),
                                          ("file", (b'"path":', b'"mode":420,"path":'))])
def test_a_member_no_record_defines_is_refused_in_chunks_segments_and_files(tmp_path, record, edit):
    data = _stored_manifest(tmp_path)
    _forget_checked()
    edited = data.replace(*edit, 1)
    assert edited != data
    with pytest.raises(FormatError, match=f"unknown (header )?{record} member"):
        Manifest.from_bytes(edited)


@pytest.mark.parametrize("pattern, replacement, message", [
    (rb'"metadata":\{\},', b"", "top-level record lacks 'metadata'"),
    (rb'"object":"[0-9a-f]{64}",', b"", "chunk record lacks 'object'"),
    (rb'"kind":"header",', b'"dtype":"U8","kind":"header",', "unknown header segment member"),
])
def test_a_record_that_lacks_a_member_or_has_one_its_kind_does_not_is_refused(tmp_path, pattern, replacement, message):
    # A missing member read as a default would make the stored text differ from the canonical JSON the digest is
    # defined over; a header segment's dtype would be dropped unchecked.
    import re

    data = _stored_manifest(tmp_path)
    _forget_checked()
    edited = re.sub(pattern, replacement, data, count=1)
    assert edited != data
    with pytest.raises(FormatError, match=message):
        Manifest.from_bytes(edited)


@pytest.mark.parametrize("field, value, message", [
    ("dtype", ["BF16"], "unknown dtype"),  # unhashable: was a TypeError before the dtype check named its type
    ("dtype", "Q7", "unknown dtype"),
    ("shape", [True, 4], "dimension must be a non-negative integer"),
    ("shape", [-1], "dimension must be a non-negative integer"),
    ("shape", "4", "bad shape"),
    ("offset", -8, "segment offset must be a non-negative integer"),
    ("size", 1.0, "segment size must be a non-negative integer"),
    ("key", "x:name", "bad segment key"),
    ("digest", "xxh3-tree:XYZ", "bad segment digest"),
    ("chunks", {}, "segment chunks must be a list"),
])
def test_a_tensor_segment_with_a_bad_field_is_refused_with_what_is_wrong(tmp_path, field, value, message):
    # The usual record takes a fast path without message formatting; anything else must still get the same checks.
    raw = json.loads(manifest_json(_stored_manifest(tmp_path)))
    seg = next(s for f in raw["files"] for s in f["segments"] if s["kind"] == "tensor")
    seg[field] = value
    _forget_checked()
    with pytest.raises(FormatError, match=message):
        Manifest.from_parsed(raw)


def test_a_tensor_segment_whose_size_disagrees_with_dtype_and_shape_is_refused(tmp_path):
    raw = json.loads(manifest_json(_stored_manifest(tmp_path)))
    seg = next(s for f in raw["files"] for s in f["segments"] if s["kind"] == "tensor")
    seg["shape"] = [*seg["shape"], 2]
    _forget_checked()
    with pytest.raises(FormatError, match="size disagrees with dtype and shape"):
        Manifest.from_parsed(raw)


def _state_record(tmp_path, man: Manifest) -> str:
    """A DEST state record embedding man, as an install writes it; the version directory's path."""
    from deltafs.format.records import dest_state_bytes, dest_state_record

    vdir = tmp_path / "v0000000001-00000000"
    record = dest_state_record(store_id=man.store_id, store_url="file:///s", version=man.version, digest=man.digest,
                               files={"model.safetensors": [1, 2]})
    (tmp_path / (vdir.name + ".json")).write_bytes(dest_state_bytes(record, man.to_bytes()))
    return str(vdir)


def _forget_states() -> None:
    from deltafs.read import dest

    dest._STATE_MEMO.clear()


def test_a_state_record_embedding_a_known_manifest_is_read_without_parsing_the_manifest(tmp_path, monkeypatch):
    """A push reads its cache's state record after decoding the same version from the store: the record's members
    are parsed around the manifest's text (10.5 MB of JSON at 70B), and the result is the full parse's."""
    from deltafs.format import records
    from deltafs.read import dest

    data = _stored_manifest(tmp_path)
    man = Manifest.from_bytes(data)
    vdir = _state_record(tmp_path, man)
    _forget_states()
    parsed: list[int] = []
    real = records.load_json
    monkeypatch.setattr(records, "load_json", lambda d, *a, **k: parsed.append(len(d)) or real(d, *a, **k))
    got, members = dest.read_version_state(vdir)
    assert got is man and parsed and max(parsed) < len(data)  # the record's own members only
    _forget_states()
    _forget_checked()  # a process that has not seen the manifest parses the whole record: the same answer
    parsed.clear()
    full, full_members = dest.read_version_state(vdir)
    assert max(parsed) > len(data) and full.to_bytes() == man.to_bytes() and full_members == members


@pytest.mark.parametrize("edit", ["a second manifest member", "spacing", "the record's version", "the manifest"])
def test_a_state_record_that_is_not_exactly_ours_is_parsed_whole(tmp_path, edit):
    from deltafs.read import dest

    data = _stored_manifest(tmp_path)
    man = Manifest.from_bytes(data)
    vdir = _state_record(tmp_path, man)
    path = vdir + ".json"
    record = open(path, "rb").read()
    if edit == "a second manifest member":  # JSON keeps the last: another manifest than the known one's text
        edited = record[:-1] + b',"manifest":{"format":"x"}}'
    elif edit == "spacing":
        edited = record.replace(b'"version":', b'"version": ')
    elif edit == "the record's version":
        edited = record[:-2] + (b"7}" if record[-2:-1] != b"7" else b"8}")
    else:
        edited = record.replace(b'"size":8192', b'"size":8190', 1)
    assert edited != record
    open(path, "wb").write(edited)
    _forget_states()
    if edit == "spacing":  # still a valid record: read in full, the same manifest and members
        got, members = dest.read_version_state(vdir)
        assert got.to_bytes() == man.to_bytes() and members["version"] == man.version
    elif edit == "the record's version":  # the members as written; the known manifest was not used for them
        got, members = dest.read_version_state(vdir)
        assert members["version"] != man.version
    else:
        with pytest.raises(FormatError):
            dest.read_version_state(vdir)


def test_a_push_reads_its_caches_state_record_around_the_manifest_it_decoded_from_the_store(tmp_path, monkeypatch):
    from deltafs.read import dest

    src = tmp_path / "src"
    src.mkdir()
    write_safetensors(str(src / "model.safetensors"), {"w": ("BF16", (4096,), bytes(range(256)) * 32)})
    store, cache = str(tmp_path / "store"), str(tmp_path / "cache")
    push(store, str(src), cache_dir=cache)
    write_safetensors(str(src / "model.safetensors"), {"w": ("BF16", (4096,), bytes(range(255, -1, -1)) * 32)})
    _forget_states()
    _forget_checked()  # a new process: only what this push decodes is known
    seen: list[bool] = []
    real = dest._known_embedded
    monkeypatch.setattr(dest, "_known_embedded", lambda data: (lambda r: seen.append(r is not None) or r)(real(data)))
    assert push(store, str(src), cache_dir=cache).kind == "delta"
    assert seen and seen[0]  # the cache's record, read after HEAD's manifest was decoded
