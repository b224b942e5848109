"""A FIFO planted in DEST's version directory where a file belongs: pull opened the local base with a blocking
open() and hung forever holding DEST's lock (a watcher too); verify --local did the same (adversarial pass)."""

from __future__ import annotations

import os

from deltafs.publish import push
from deltafs.testing.checkpoints import files_of

from .conftest import deltafs


def test_a_fifo_in_the_served_version_is_a_damaged_base_not_a_hang(tmp_path, store, maker):
    dest = tmp_path / "dest"
    deltafs("pull", store, dest, check=0)
    victim = max((p for p in os.listdir(dest) if os.path.isfile(dest / p)), key=lambda p: os.path.getsize(dest / p))
    real = os.path.realpath(dest / victim)
    os.unlink(real)
    os.mkfifo(real)
    proc = deltafs("verify", store, "--local", dest, timeout=60)
    assert proc.returncode == 6 and victim in proc.stdout, (proc.stdout, proc.stderr)
    maker.advance()
    src = maker.write()
    push(store, src)
    deltafs("pull", store, dest, check=0, timeout=60)  # rebuilt from a full version (a TimeoutExpired before)
    assert files_of(dest) == files_of(src)
    deltafs("verify", store, "--local", dest, check=0, timeout=60)


def test_deltafs_own_link_left_dangling_is_replaced_without_force(tmp_path, store):
    """DEST.deltafs deleted, DEST's link left pointing at nothing: every pull (and a watcher, for ever) refused it
    as "whose state record is missing" and told the user to use --force, which watch does not have."""
    dest = tmp_path / "dest"
    deltafs("pull", store, dest, check=0)
    import shutil

    shutil.rmtree(str(dest) + ".deltafs")
    assert os.path.islink(dest) and not os.path.exists(dest)
    deltafs("pull", store, dest, check=0)
    deltafs("verify", store, "--local", dest, check=0)
    # A link to a version directory that is still there but lost its record is not deltafs's to guess about.
    real = os.path.realpath(dest)
    os.unlink(real + ".json")
    assert deltafs("pull", store, dest).returncode == 9
