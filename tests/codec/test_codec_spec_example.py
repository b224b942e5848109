"""The worked example in manifests/FORMAT.md ("Chunk encodings") is what the codec writes and reads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from deltafs import codec

SPEC = Path(__file__).resolve().parents[2] / "manifests" / "FORMAT.md"


def example_from_spec() -> tuple[dict[str, object], bytes]:
    text = SPEC.read_text()
    block = text[text.index("<!-- codecs:begin -->"):text.index("<!-- codecs:end -->")]
    record = re.search(r"record:\s+(\{.*?\})\s*\n\s*object:", block, re.DOTALL)
    payload = re.search(r"object:\s+([0-9a-f |]+)\n", block)
    assert record and payload, "the spec's sparse example is missing"
    rec = json.loads(" ".join(record.group(1).split()).replace(", ", ","))
    return rec, bytes.fromhex(payload.group(1).replace("|", ""))


def test_spec_example_encodes_and_decodes_byte_for_byte() -> None:
    base = np.arange(0x3C00, 0x3C00 + 20, dtype="<u2")
    new = base.copy()
    new[3] += 1
    new[4] -= 1
    new[17] += 5
    rec, payload = example_from_spec()
    enc = codec.encode(new.view(np.uint8), base.view(np.uint8), 2)
    assert enc.codec == rec
    assert enc.payload == payload
    out = codec.decode(rec, payload, base.view(np.uint8), base.nbytes, 2)
    assert out.tobytes() == new.tobytes()
