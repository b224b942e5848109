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
        assert stored[:4] == b"\x28\xb5\x2f\xfd"  # format v2 and v3: one zstd frame
        data = manifest_json(stored)
        raw = json.loads(data)
        assert raw["format_version"] == 3
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


def test_json_depth_is_measured_on_the_text_outside_strings():
    import json
    import random

    from deltafs.format.records import load_json, text_depth

    def depth(v):
        return 1 + max(map(depth, v.values() if isinstance(v, dict) else v), default=0) \
            if isinstance(v, (dict, list)) else 0

    rnd = random.Random(0)

    def gen(d):
        if d > 6 or rnd.random() < 0.3:
            return rnd.choice([1, 2.5, None, True, "a]b", 'q"[{', "\\", "é[", "}}}"])
        if rnd.random() < 0.5:
            return [gen(d + 1) for _ in range(rnd.randint(0, 3))]
        return {rnd.choice(["k", "[", "}", '"{']) + str(i): gen(d + 1) for i in range(rnd.randint(0, 3))}

    for _ in range(2000):
        v = gen(0)
        for text in (json.dumps(v), json.dumps(v, ensure_ascii=False)):
            assert text_depth(text.encode()) == depth(v), text
    assert text_depth(b'{"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}') == 1
    assert text_depth(b'{"a":"","b":"[","c":["]",{"d":""}],"e":""}') == 3  # empty strings next to bracket ones
    assert text_depth(b"[" * 40 + b"]" * 40, cap=32) == 33  # counting stops past the cap
    with pytest.raises(FormatError, match="nested more than 3"):
        load_json(b'{"a": [[[1]]]}', "a record", max_depth=3)
    assert load_json(b'{"a": [["[[[[[[["]]}', "a record", max_depth=3) == {"a": [["[[[[[[["]]}


def test_nan_and_infinity_are_not_json():
    from deltafs.format.records import load_json

    for text in (b'{"a": NaN}', b'[Infinity]', b'[-Infinity]'):
        with pytest.raises(FormatError, match="not valid JSON"):
            load_json(text, "a record")
