"""10.9: `pull` and `pull --once` notice an edited file in the current DEST and repair it."""

from __future__ import annotations

import os

from deltafs.publish import push
from deltafs.read.pull import pull
from deltafs.testing.checkpoints import files_of

from .conftest import deltafs


def test_pull_once_repairs_an_edited_file(tmp_path, maker):
    store = str(tmp_path / "store")
    src = maker.write()
    push(store, src)
    maker.advance()
    src = maker.write("b")
    push(store, src)
    dest = tmp_path / "dest"
    pull(store, str(dest), version=1)
    pull(store, str(dest))  # version 2 as a delta: its unchanged files are hard links
    target = dest / "config.json"
    data = target.read_bytes()
    os.unlink(target)  # an operator's edit: a new file of the same size
    target.write_bytes(data.replace(b"48", b"64"))
    proc = deltafs("pull", store, dest, "--once", check=0)
    assert "repaired" in proc.stdout and "config.json" in proc.stdout
    assert files_of(dest) == files_of(src)
    assert deltafs("pull", store, dest, "--once").returncode == 100  # repaired: current again


def test_pull_verify_finds_an_edit_that_kept_size_and_mtime(tmp_path, store, maker):
    dest = tmp_path / "dest"
    pull(store, str(dest))
    target = dest / "model.safetensors"
    st = os.stat(target)
    with open(target, "r+b") as fh:  # flip one byte in place, then put the mtime back
        fh.seek(st.st_size - 1)
        last = fh.read(1)
        fh.seek(st.st_size - 1)
        fh.write(bytes([last[0] ^ 1]))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert deltafs("pull", store, dest, "--once").returncode == 100  # the cheap check cannot see it
    proc = deltafs("pull", store, dest, "--once", "--verify", check=0)
    assert "repaired" in proc.stdout
    assert files_of(dest) == files_of(os.path.join(maker.root, "ckpt-0"))
