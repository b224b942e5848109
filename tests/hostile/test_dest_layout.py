"""10.7: a version whose files cannot coexist on disk (a file and a directory of one name, a name longer
than filesystems allow) fails pull with exit 5 naming the file, before anything is written, and
`verify --all` reports it."""

from __future__ import annotations

import dataclasses
import os

import pytest

from deltafs.format.manifest import Head, Manifest, manifest_key

from .conftest import deltafs, one_line


def _rename_file(store: str, old: str, new: str) -> None:
    """Rewrite version 1 so that file `old` is called `new` (and HEAD to match it)."""
    path = os.path.join(store, manifest_key(1))
    man = Manifest.decode(open(path, "rb").read())
    files = tuple(dataclasses.replace(f, path=new) if f.path == old else f for f in man.files)
    man = dataclasses.replace(man, files=files).seal()
    with open(path, "wb") as fh:
        fh.write(man.encode())
    with open(os.path.join(store, "HEAD"), "wb") as fh:
        fh.write(Head(1, man.digest).to_bytes())


@pytest.mark.parametrize("new,needle", [("config.json/tokenizer.json", "both a file and the directory"),
                                        ("tokenizer/" + "t" * 300 + ".json", "longer than the 255")])
def test_unlayable_version_fails_cleanly_and_verify_notices(tmp_path, store, new, needle):
    _rename_file(store, "tokenizer/tokenizer.json", new)
    one_line(deltafs("pull", store, tmp_path / "dest"), 5, "version 1", needle)
    assert not os.path.lexists(tmp_path / "dest")
    assert [n for n in os.listdir(tmp_path / "dest.deltafs") if n.startswith(("staging-", "v"))] == []
    proc = deltafs("verify", store, "--all", "--quick")
    assert proc.returncode == 6 and needle in proc.stdout
