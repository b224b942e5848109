"""10.2: a local store's writer never writes through a symlinked chunks/xx directory planted in it."""

from __future__ import annotations

import os

from .conftest import deltafs, one_line


def test_push_refuses_a_planted_chunk_directory_symlink(tmp_path, store, maker):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    chunks = os.path.join(store, "chunks")
    for prefix in (f"{i:02x}" for i in range(256)):  # every prefix the next chunk could land in
        if not os.path.lexists(os.path.join(chunks, prefix)):
            os.symlink(elsewhere, os.path.join(chunks, prefix))
    maker.advance()
    one_line(deltafs("push", maker.write(), store), 3, "symlink", chunks)
    assert os.listdir(elsewhere) == []


def test_push_refuses_a_planted_symlink_higher_up_the_chunk_path(tmp_path, store, maker):
    """Every component below the store root is opened without following links, chunks/ itself included."""
    import shutil

    elsewhere = tmp_path / "elsewhere"
    chunks = os.path.join(store, "chunks")
    shutil.move(chunks, elsewhere)  # the real chunks now live elsewhere; the store names them through a link
    os.symlink(elsewhere, chunks)
    before = sorted(os.walk(elsewhere))
    maker.advance()
    one_line(deltafs("push", maker.write(), store), 3, "symlink", chunks)
    assert sorted(os.walk(elsewhere)) == before
