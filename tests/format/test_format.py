"""The spec's artifacts stay true: examples and real manifests validate against the JSON Schema."""

from __future__ import annotations

import json
import os

import jsonschema
import pytest

from deltafs.errors import FormatError
from deltafs.format.manifest import (
    Head,
    Manifest,
    StoreConfig,
    canonical_json,
    check_relpath,
    manifest_json,
    manifest_key,
)
from deltafs.publish import push

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "manifests")
SCHEMA = json.load(open(os.path.join(ROOT, "manifest.schema.json")))


@pytest.mark.parametrize("name", ["full.json", "delta.json"])
def test_examples_validate(name):
    raw = json.load(open(os.path.join(ROOT, "examples", name)))
    jsonschema.validate(raw, SCHEMA)
    man = Manifest.from_bytes(canonical_json(raw))
    assert man.kind == name.split(".")[0]
    StoreConfig.from_bytes(open(os.path.join(ROOT, "examples", "deltafs.json"), "rb").read())
    Head.from_bytes(open(os.path.join(ROOT, "examples", "HEAD"), "rb").read())


def test_real_manifests_validate_and_are_canonical(tmp_path, maker):
    store = tmp_path / "store"
    push(str(store), maker.write())
    maker.advance()
    push(str(store), maker.write())
    for v in (1, 2):
        stored = (store / manifest_key(v)).read_bytes()
        assert stored[:4] == b"\x28\xb5\x2f\xfd"  # format v2: one zstd frame
        data = manifest_json(stored)
        raw = json.loads(data)
        assert raw["format_version"] == 2
        jsonschema.validate(raw, SCHEMA)
        assert canonical_json(raw) == data
        assert Manifest.decode(stored).to_bytes() == data


@pytest.mark.parametrize("path", ["../x", "/abs", "a/../../b", "a//b", "a/./b", "a\\b", "C:/x", "", ".", "a/"])
def test_unsafe_paths_are_refused_by_code_and_schema(path):
    with pytest.raises(FormatError):
        check_relpath(path)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(path, {**SCHEMA["$defs"]["relpath"], "$defs": SCHEMA["$defs"]})


@pytest.mark.parametrize("path", ["model.safetensors", "tokenizer/tokenizer.json", "a/b/c.bin", ".gitattributes"])
def test_safe_paths_pass(path):
    assert check_relpath(path) == path
    jsonschema.validate(path, SCHEMA["$defs"]["relpath"])


def test_v1_manifests_of_the_previous_release_validate():
    data = os.path.join(os.path.dirname(__file__), "..", "data", "v1_store", "store", "manifests")
    for name in sorted(os.listdir(data)):
        stored = open(os.path.join(data, name), "rb").read()
        raw = json.loads(stored)
        assert raw["format_version"] == 1
        jsonschema.validate(raw, SCHEMA)
        man = Manifest.decode(stored)
        assert man.to_bytes() == stored  # read, then written back, a v1 manifest keeps its bytes (and digest)


def test_delta_codecs_are_exactly_the_codecs_that_need_a_base():
    # Chain planning stops at a record whose codec is not in DELTA_CODECS: a codec that needs the
    # base but is missing there would be decoded without one.
    from deltafs.codec.registry import _REGISTRY
    from deltafs.format.manifest import DELTA_CODECS

    for name, cls in _REGISTRY.items():
        assert (name in DELTA_CODECS) == cls.needs_base, name
