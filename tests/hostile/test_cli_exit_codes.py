"""The one exit-code table: the README says exactly what deltafs.errors says, and a missing chunk is 6."""

from __future__ import annotations

import os
import re

from deltafs.errors import EXIT_MEANINGS
from deltafs.format.manifest import chunk_key
from deltafs.publish import push
from deltafs.store.repo import Repository

from .conftest import deltafs, one_line

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def test_readme_exit_code_table_is_the_table_in_errors():
    text = open(README, encoding="utf-8").read()
    rows = dict(re.findall(r"^\| (\d+) \| (.+?) \|$", text.split("### Exit codes", 1)[1].split("\n## ", 1)[0], re.M))
    assert {int(k): v for k, v in rows.items()} == EXIT_MEANINGS


def test_missing_chunk_exits_6_naming_version_and_chunk(tmp_path, maker):
    store = str(tmp_path / "store")
    push(store, maker.write())
    maker.advance()
    push(store, maker.write("b"))
    repo = Repository.open(store)
    man = repo.manifest(1)
    oid = next(ch.object for f in man.files for s in f.segments for ch in s.chunks if ch.object)
    os.unlink(os.path.join(store, chunk_key(oid)))
    line = one_line(deltafs("pull", store, tmp_path / "dest", "--version", "1"), 6, "version 1", oid)
    assert "unreachable" not in line
    assert not os.path.lexists(tmp_path / "dest")
