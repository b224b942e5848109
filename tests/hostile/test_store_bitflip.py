"""A chunk whose bytes do not match its id is fetched again like a transient error, then reported as exit 6."""

from __future__ import annotations

import json
import os

from deltafs.publish import push
from deltafs.store.repo import Repository
from deltafs.testing.checkpoints import run_cli

FAST = json.dumps({"deltafs": {"attempts": 3, "base_delay": 0.01, "max_delay": 0.02}})


def test_damaged_chunk_is_retried_then_an_integrity_failure(tmp_path, maker):
    url = str(tmp_path / "store")
    push(url, maker.write())
    man = Repository.open(url).manifest(1)
    victim = next(c.object for f in man.files for s in f.segments for c in s.chunks if c.object)
    path = os.path.join(url, "chunks", victim[:2], victim)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(path, "wb").write(bytes(data))
    proc = run_cli("pull", url, tmp_path / "dest", "--storage-options", FAST)
    assert proc.returncode == 6, (proc.returncode, proc.stdout, proc.stderr)
    assert victim in proc.stderr and "corrupt" in proc.stderr and "checked 3 times" in proc.stderr, proc.stderr
    assert proc.stderr.count("arrived damaged") == 2, proc.stderr  # fetched 3 times in all
    assert not os.path.lexists(tmp_path / "dest")
    report = run_cli("verify", url, "--storage-options", FAST)
    assert report.returncode == 6 and victim in report.stdout
    # Named once, fetched once (3 attempts): the rebuild that needs it is not tried again (it was reported twice,
    # and fetched six times).
    assert report.stdout.count(victim) == 2 and report.stdout.count("corrupt") == 1, report.stdout  # expected, got
    assert "version 1: not rebuilt: it needs 1 chunk(s) reported above" in report.stdout, report.stdout
    assert report.stderr.count("arrived damaged") == 2, report.stderr


def test_verify_names_the_version_once():
    """Many messages name their version already ("version 2: model.safetensors: tensor w digest mismatch"); verify
    printed "version 2: version 2: ..."."""
    from deltafs.errors import IntegrityError
    from deltafs.maintenance.verify import _about

    assert _about(2, IntegrityError("version 2: f: tensor w digest mismatch")) == "version 2: f: tensor w digest mismatch"
    assert _about(2, IntegrityError("chunk ab is corrupt")) == "version 2: chunk ab is corrupt"
    assert _about(2, IntegrityError("version 21: x")) == "version 2: version 21: x"


def test_a_chunk_that_is_a_link_or_too_large_is_reported_at_once(tmp_path, maker):
    """What the store holds under a chunk's name is not that chunk and never will be (a link, a FIFO, more bytes
    than the manifest says): exit 6 saying what it is, without the retries meant for transfer errors (it used to
    be retried and then called "an object larger than N bytes", also for a link to a byte-identical copy)."""
    url = str(tmp_path / "store")
    push(url, maker.write())
    man = Repository.open(url).manifest(1)
    victim = next(c.object for f in man.files for s in f.segments for c in s.chunks if c.object)
    path = os.path.join(url, "chunks", victim[:2], victim)
    copy = str(tmp_path / "copy")
    os.replace(path, copy)
    os.symlink(copy, path)
    proc = run_cli("pull", url, tmp_path / "dest", "--storage-options", FAST)
    assert proc.returncode == 6 and "arrived damaged" not in proc.stderr, proc.stderr
    assert victim in proc.stderr and "is a symbolic link, not an object deltafs wrote" in proc.stderr, proc.stderr
    os.unlink(path)
    with open(path, "wb") as fh:
        fh.write(open(copy, "rb").read() + b"\0" * 4096)
    proc = run_cli("pull", url, tmp_path / "dest", "--storage-options", FAST)
    assert proc.returncode == 6 and "arrived damaged" not in proc.stderr, proc.stderr
    assert "is larger than the" in proc.stderr and not os.path.lexists(tmp_path / "dest")
