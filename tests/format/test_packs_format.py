"""Format 3 chunk records: `pack` says where a payload lies in a shared object; readers refuse records that
would read outside it, disagree on its size, or do not match their manifest's format version."""

from __future__ import annotations

import dataclasses
import json
import os

import jsonschema
import pytest

from deltafs.errors import FormatError
from deltafs.format.manifest import ChunkRef, Manifest, canonical_json, validate

SCHEMA = json.load(open(os.path.join(os.path.dirname(__file__), "..", "..", "manifests", "manifest.schema.json")))
OID = "ab" * 32
GOOD = {"index": 0, "size": 4096, "codec": {"name": "dense", "width": 4}, "object": OID, "stored": 100,
        "pack": [20, 300]}


def test_a_packed_record_round_trips_and_names_its_slice():
    rec = ChunkRef.from_json(dict(GOOD), 3)
    assert rec.pack == (20, 300) and rec.object_bytes == 300 and rec.stored == 100
    assert rec.to_json(3) == GOOD
    assert rec.payload_of(bytes(range(256)) + bytes(44)) == bytes(range(20, 120))
    plain = ChunkRef.from_json({**GOOD, "pack": None}, 3)
    assert plain.object_bytes == 100 and plain.payload_of(b"x" * 100) == b"x" * 100


@pytest.mark.parametrize("pack", [[250, 300], [0, 99], [-1, 300], [1.0, 300], [True, 300], [1, 2, 3], [1], "0,300",
                                  {"at": 0}])
def test_a_pack_that_is_not_a_slice_of_its_object_is_refused(pack):
    with pytest.raises(FormatError):
        ChunkRef.from_json({**GOOD, "pack": pack}, 3)


def test_pack_members_follow_the_format_version():
    with pytest.raises(FormatError, match="pack"):
        ChunkRef.from_json({k: v for k, v in GOOD.items() if k != "pack"}, 3)  # format 3: required
    with pytest.raises(FormatError, match="pack"):
        ChunkRef.from_json(dict(GOOD), 2)  # format 2: unknown member
    with pytest.raises(FormatError, match="object"):
        ChunkRef.from_json({**GOOD, "object": None}, 3)  # a pack without an object
    chunk_schema = {**SCHEMA["$defs"]["chunk_v3"], "$defs": SCHEMA["$defs"]}
    jsonschema.validate(GOOD, chunk_schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**GOOD, "object": None}, chunk_schema)
    with pytest.raises(FormatError, match="packed"):
        ChunkRef.from_json(dict(GOOD), 3).to_json(2)


def _manifest_with_two_packed_records(tmp_path) -> Manifest:
    import numpy as np
    from safetensors.numpy import save_file

    from deltafs.publish import push
    from deltafs.store.repo import Repository

    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    save_file({f"t.{i}": rng.standard_normal(64).astype(np.float32) for i in range(4)}, str(src / "model.safetensors"))
    store = str(tmp_path / "store")
    push(store, str(src), cache_dir=str(tmp_path / "cache"))
    return Repository.open(store).manifest(1)


def test_records_that_disagree_on_an_objects_size_are_refused(tmp_path):
    man = _manifest_with_two_packed_records(tmp_path)
    raw = json.loads(man.to_bytes())
    jsonschema.validate(raw, SCHEMA)
    chunks = [c for f in raw["files"] for s in f["segments"] for c in s["chunks"] if c["pack"]]
    assert len(chunks) >= 2 and len({c["object"] for c in chunks}) == 1
    f = man.files[0]
    seg = f.segments[-1]
    ch = seg.chunks[0]
    assert ch.pack is not None
    bad_ch = dataclasses.replace(ch, pack=(ch.pack[0], ch.pack[1] + 1))
    bad_seg = dataclasses.replace(seg, chunks=(bad_ch,))
    bad = dataclasses.replace(man, files=(dataclasses.replace(f, segments=f.segments[:-1] + (bad_seg,)),))
    with pytest.raises(FormatError, match="another size"):
        validate(bad)
    # The same edit in stored JSON (resealed, so only the invariant can catch it) is refused on read too.
    sealed = bad.seal()
    with pytest.raises(FormatError, match="another size"):
        Manifest.from_bytes(canonical_json({**sealed.body(), "digest": sealed.digest}))


@pytest.mark.parametrize("packed", [True, False])
def test_an_object_larger_than_a_chunk_grid_can_produce_is_refused_before_any_fetch(tmp_path, packed):
    from deltafs.format.manifest import OBJECT_SLACK

    man = _manifest_with_two_packed_records(tmp_path)
    f = man.files[0]
    seg = f.segments[-1]
    ch = seg.chunks[0]
    huge = man.chunk_bytes + OBJECT_SLACK + 1
    bad_ch = dataclasses.replace(ch, pack=(0, huge)) if packed else dataclasses.replace(ch, stored=huge, pack=None)
    bad = dataclasses.replace(man, files=(dataclasses.replace(
        f, segments=f.segments[:-1] + (dataclasses.replace(seg, chunks=(bad_ch,)),)),))
    with pytest.raises(FormatError, match="more than a chunk grid"):
        validate(bad)
