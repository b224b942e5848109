"""Headers the safetensors loaders refuse are refused by push too (exit 2) before anything is written: a version
holding them could be committed and then read by no one (a JSON `true` as a dimension stuck the store), or the
push stopped late with an internal error (found by an adversarial pass)."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

from deltafs.errors import UsageError
from deltafs.format.records import load_json
from deltafs.errors import FormatError
from deltafs.publish import push_tensors
from tests.hostile.conftest import deltafs, one_line


def _raw(path, header_text: bytes, data: bytes) -> str:
    os.makedirs(path, exist_ok=True)
    body = header_text + b" " * (-len(header_text) % 8)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body + data)
    return str(path)


def _header(**entries) -> bytes:
    return json.dumps(entries).encode()


CASES = {
    "boolean dimension": (_header(w={"dtype": "F32", "shape": [True, 4], "data_offsets": [0, 16]}), 16, "bad shape"),
    "boolean offsets": (_header(w={"dtype": "U8", "shape": [1], "data_offsets": [False, True]}), 1, "bad data offsets"),
    "dimension past 64 bits": (_header(w={"dtype": "U8", "shape": [1 << 64], "data_offsets": [0, 0]}), 0, "bad shape"),
    "dtype as a list": (_header(w={"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}), 4, "does not know"),
    "byte-order mark": (b"\xef\xbb\xbf" + _header(w={"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}), 1,
                        "byte-order mark"),
    "lone surrogate name": (b'{"a\\ud800":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', 1, "not valid Unicode"),
    "tensor named __metadata__": (_header(__metadata__={"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}), 1,
                                  "a tensor is named __metadata__"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_header_the_loaders_refuse_is_exit_2_and_writes_nothing(tmp_path, case):
    header, nbytes, words = CASES[case]
    src = _raw(tmp_path / "src", header, b"\x00" * nbytes)
    store = tmp_path / "store"
    one_line(deltafs("push", src, store), 2, words)
    assert not store.exists()


def test_a_file_name_that_is_not_utf8_is_exit_2_and_writes_nothing(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    with open(os.path.join(os.fsencode(src), b"bad\xff\xfe.json"), "wb") as f:
        f.write(b"{}")
    store = tmp_path / "store"
    one_line(deltafs("push", src, store), 2, "unsupported file name", "not valid Unicode")
    assert not store.exists()


@pytest.mark.parametrize("tensors, words", [
    ({"a\ud800": torch.zeros(2)}, "not valid Unicode"),
    ({"__metadata__": torch.zeros(2)}, "cannot be named __metadata__"),
    ({"s": torch.eye(3).to_sparse()}, "s is a sparse_coo tensor"),
    ({"n": torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])}, "n is a nested tensor"),
], ids=["surrogate", "metadata-name", "sparse", "nested"])
def test_push_tensors_refuses_what_safetensors_cannot_hold_by_name(tmp_path, tensors, words):
    with pytest.raises(UsageError, match=words):
        push_tensors(str(tmp_path / "store"), tensors)
    assert not (tmp_path / "store").exists()


def test_a_record_holding_a_lone_surrogate_is_a_format_error():
    """A manifest path or metadata value "\\ud800" (sealed over the stored text) crashed pull, show and log with an
    internal error; every record the store holds is parsed by load_json."""
    with pytest.raises(FormatError, match="not valid Unicode"):
        load_json(b'{"path": "bad\\ud800.txt"}', "manifest")
    with pytest.raises(FormatError, match="not valid Unicode"):
        load_json(b'{"path": "bad\xed\xa0\x80.txt"}', "manifest")
    assert load_json(b'{"m": "\\ud83d\\ude00"}', "manifest") == {"m": "\U0001f600"}  # a pair is a character


def test_a_record_of_millions_of_tiny_values_is_refused_before_it_is_parsed():
    """A 22 KB zstd manifest expanding to 250 MiB of "[[],[],...]" took 6.8 GB and 40 s to refuse; deltafs's own
    records hold one JSON value per 12-17 bytes of text."""
    import time

    bomb = b'{"metadata":{"x":[' + b"[]," * (1 << 20) + b'[]]}}'
    t0 = time.monotonic()
    with pytest.raises(FormatError, match="JSON values in"):
        load_json(bomb, "manifest")
    assert time.monotonic() - t0 < 1
    ok = b'{"files":[' + b",".join(b'{"path":"f%06d.json","size":1234567,"digest":"xxh3-tree:0123456789abcdef"}' % i
                                    for i in range(20000)) + b"]}"
    assert len(ok) > 1 << 20 and len(load_json(ok, "manifest")["files"]) == 20000


def test_packed_elements_that_do_not_fill_whole_bytes_are_refused(tmp_path):
    """Three F4 elements (12 bits in 2 bytes): safe_open refuses the file, push took it."""
    src = _raw(tmp_path / "src", _header(w={"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}), b"\x00\x00")
    one_line(deltafs("push", src, tmp_path / "store"), 2, "3 F4 elements, which do not fill whole bytes")
    assert not (tmp_path / "store").exists()


def test_a_manifest_cut_short_is_called_that(tmp_path):
    """A manifest whose zstd frame was cut short decoded to nothing and was reported as "not valid JSON"."""
    from deltafs.format.manifest import Manifest, stored_manifest

    frame = stored_manifest(b'{"format": "deltafs.manifest", "x": "' + b"y" * 100_000 + b'"}')
    with pytest.raises(FormatError, match="cut short or damaged: its compressed frame gave"):
        Manifest.decode(frame[: len(frame) // 2])
