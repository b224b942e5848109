"""Before an HTTP engine re-reads a checkpoint in its pause, deltafs reads it once outside the pause."""

from __future__ import annotations

import os

from deltafs.engines.sglang import SGLangEngine
from deltafs.engines.switch import warm_page_cache
from deltafs.engines.vllm import VLLMEngine


def test_every_file_is_read_once_and_links_are_not_followed(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "model.safetensors").write_bytes(os.urandom(3 << 20))
    (tmp_path / "sub" / "tokenizer.json").write_bytes(b"{}")
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.write_bytes(b"x" * 1000)
    os.symlink(outside, tmp_path / "link")
    assert warm_page_cache(str(tmp_path), block=1 << 20) == (3 << 20) + 2


def test_disk_loading_engines_ask_for_it():
    assert SGLangEngine.loads_from_disk and VLLMEngine.loads_from_disk
