"""Long chains: any version can be pulled, in any order, into the same DEST."""

from __future__ import annotations

import random

import pytest

from deltafs.maintenance.log import log
from deltafs.maintenance.verify import verify
from deltafs.publish import push
from deltafs.read.pull import local_version, pull
from deltafs.testing.checkpoints import files_of


def test_chain_of_24_versions_pulled_at_random(tmp_path, maker):
    store = str(tmp_path / "store")
    expected = {}
    for _ in range(24):
        src = maker.write()
        res = push(store, src, keyframe_every=10, metadata={"step": maker.step})
        expected[res.version] = files_of(src)
        maker.advance()
    entries = log(store)
    assert [e.version for e in entries] == list(range(1, 25))
    assert [e.version for e in entries if e.kind == "full"] == [1, 11, 21]
    assert entries[4].metadata == {"step": 4}
    dest = tmp_path / "dest"
    order = list(expected)
    random.Random(7).shuffle(order)
    for v in order[:12] + [24, 23, 24]:
        res = pull(store, str(dest), version=v)
        assert files_of(dest) == expected[v], v
        assert local_version(str(dest)).version == v
    assert verify(store, all_versions=True).ok


def test_incremental_pull_reads_only_new_chunks(tmp_path, maker):
    store = str(tmp_path / "store")
    dest = str(tmp_path / "dest")
    push(store, maker.write())
    first = pull(store, dest)
    maker.advance()
    delta = push(store, maker.write())
    second = pull(store, dest)
    assert not second.from_full and second.previous == 1
    assert second.bytes_read <= delta.bytes_written
    assert second.bytes_read * 5 < first.bytes_read


def test_pull_same_version_twice_is_a_no_op(tmp_path, maker):
    store = str(tmp_path / "store")
    push(store, maker.write())
    dest = str(tmp_path / "dest")
    assert pull(store, dest).updated
    again = pull(store, dest)
    assert not again.updated and again.bytes_read == 0


def test_old_version_dirs_are_cleaned_up(tmp_path, maker):
    import os

    store = str(tmp_path / "store")
    dest = str(tmp_path / "dest")
    for _ in range(5):
        push(store, maker.write())
        pull(store, dest)
        maker.advance()
    dirs = [n for n in os.listdir(dest + ".deltafs") if n.startswith("v") and not n.endswith(".json")]
    assert len(dirs) == 2  # the current version and the one before it (an engine may still read it)


@pytest.mark.parametrize("holds_a_version", [True, False])
def test_a_version_gc_removes_while_it_is_pulled_is_reported_as_gone(tmp_path, maker, monkeypatch, holds_a_version):
    """gc --grace 0 removing the target mid-pull: the pull said "version 2 is not in STORE" for an intermediate
    version the user never asked for (exit 4), or "chunk ... missing" (exit 6) from an empty DEST (adversarial
    pass). Both name the asked-for version as removed while it was read, exit 4; DEST is untouched."""
    from deltafs.errors import VersionNotFoundError
    from deltafs.maintenance.gc import gc
    import importlib

    pull_module = importlib.import_module("deltafs.read.pull")

    store = str(tmp_path / "store")
    dest = str(tmp_path / "dest")
    for step in range(4):
        push(store, maker.write(), full=step == 3)  # a full version 4: gc may drop 1-3
        maker.advance()
    if holds_a_version:
        pull(store, dest, version=1)
    real = pull_module._materialize
    calls = []

    def gc_first(*args, **kwargs):
        if not calls:
            gc(store, keep_last=1, grace=0, settle=0)
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(pull_module, "_materialize", gc_first)
    with pytest.raises(VersionNotFoundError, match="version 3 is not in .*: it was removed while this pull read it"):
        pull(store, dest, version=3)
    assert (local_version(dest).version if holds_a_version else local_version(dest)) == (1 if holds_a_version else None)


def test_a_pull_from_a_full_version_links_the_files_dest_holds_unchanged(tmp_path, maker):
    """A pull whose chain starts at a full version (DEST behind a keyframe without a bridge) rebuilt every file from
    the store, also those DEST held unchanged, while `pull --dry-run` counted them as linked. They are re-hashed and
    hard-linked, as the dry run says."""
    import json
    import os

    from deltafs.read.inspect import plan_pull

    store, dest = str(tmp_path / "store"), str(tmp_path / "dest")
    frozen = os.urandom(1 << 20)  # a file no step changes (a frozen tower, a tokenizer)
    for n in range(3):
        src = maker.write(f"s{n}")
        with open(os.path.join(src, "frozen.bin"), "wb") as fh:
            fh.write(frozen)
        push(store, src, full=n == 2, bridge=False)
        maker.advance()
    pull(store, dest, version=1)
    held = os.path.join(os.path.realpath(dest), "frozen.bin")
    plan = plan_pull(store, dest)
    assert plan.files_linked >= 1
    res = pull(store, dest)
    assert res.version == 3 and res.from_full
    assert os.stat(os.path.join(dest, "frozen.bin")).st_ino == os.stat(held).st_ino
    assert res.bytes_read == plan.bytes_to_read < len(frozen)
    assert files_of(dest) == files_of(src) and verify(store, local=dest).ok
    assert json.loads(json.dumps(plan.to_json()))["files_linked"] == plan.files_linked


def test_a_missing_parent_manifest_is_named_as_damage_and_a_dest_holding_it_still_updates(tmp_path, maker):
    """manifests/v2 removed by hand: `pull --version 4` said "version 2 is not in STORE" (exit 4, as if the version
    asked for were missing), and a DEST holding exactly version 2 could not update although it needs nothing from
    that manifest. Now: exit 6 naming version 4; the DEST at version 2 updates."""
    import os

    from deltafs.errors import IntegrityError
    from deltafs.testing.checkpoints import run_cli

    store = str(tmp_path / "store")
    srcs = {}
    for v in range(1, 5):
        srcs[v] = maker.write(f"s{v}")
        push(store, srcs[v])
        maker.advance()
    at2 = str(tmp_path / "at2")
    pull(store, at2, version=2)
    os.unlink(os.path.join(store, "manifests", "v0000000002.json"))
    proc = run_cli("pull", store, tmp_path / "fresh", "--version", "4")
    assert proc.returncode == 6, proc.stderr
    assert "version 4 cannot be rebuilt: version 2, the parent of version 3, is missing" in proc.stderr
    with pytest.raises(IntegrityError):
        pull(store, str(tmp_path / "fresh2"), version=4)
    res = pull(store, at2, version=4)
    assert res.previous == 2 and not res.from_full and files_of(at2) == files_of(srcs[4])
