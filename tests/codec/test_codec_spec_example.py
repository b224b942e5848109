"""The worked examples in manifests/FORMAT.md ("Chunk encodings") are what the codec writes and reads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from codec_helpers import loops

from deltafs import codec

SPEC = Path(__file__).resolve().parents[2] / "manifests" / "FORMAT.md"


def example_from_spec(name: str) -> tuple[dict[str, object], bytes]:
    """The record and object bytes of the spec's example for the codec called name."""
    text = SPEC.read_text()
    block = text[text.index("<!-- codecs:begin -->"):text.index("<!-- codecs:end -->")]
    for found in re.finditer(r"record:\s+(\{.*?\})\s*\n\s*object:\s+([0-9a-f |]+)\n", block, re.DOTALL):
        rec = json.loads(" ".join(found.group(1).split()).replace(", ", ","))
        if rec["name"] == name:
            return rec, bytes.fromhex(found.group(2).replace("|", ""))
    raise AssertionError(f"the spec's {name} example is missing")


def test_spec_example_encodes_and_decodes_byte_for_byte() -> None:
    base = np.arange(0x3C00, 0x3C00 + 20, dtype="<u2")
    new = base.copy()
    new[3] += 1
    new[4] -= 1
    new[17] += 5
    rec, payload = example_from_spec("sparse")
    enc = codec.encode(new.view(np.uint8), base.view(np.uint8), 2)
    assert enc.codec == rec
    assert enc.payload == payload
    out = codec.decode(rec, payload, base.view(np.uint8), base.nbytes, 2)
    assert out.tobytes() == new.tobytes()


def test_spec_gamma_example_encodes_and_decodes_byte_for_byte() -> None:
    base = np.array([0x3F800000 + 7 * i for i in range(6)], "<u4")
    new = (base.astype(np.int64) + np.array([5, -3, 0, 1, 12, -2])).astype("<u4")
    rec, payload = example_from_spec("gamma")
    for use in (True, False):  # the compiled loops and numpy write the same bytes
        with loops(use):
            gamma, written = codec.Gamma.encode(new, base)
            assert gamma.to_json() == rec
            assert written == payload
            out = codec.decode(rec, payload, base.view(np.uint8), base.nbytes, 4)
            assert out.tobytes() == new.tobytes()
