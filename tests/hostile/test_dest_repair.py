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


def test_a_symlink_planted_in_dest_is_repaired_into_a_real_file(tmp_path, maker):
    """A file of DEST replaced by a symlink to a copy outside DEST: the pull said "repaired" but hard-linked the
    symlink itself into the new version (link(2) does not follow it), at every pull, and `verify --local` followed it
    and said ok. Editing the outside file then changed what the engine loads."""
    store = str(tmp_path / "store")
    src = maker.write()
    push(store, src)
    dest = tmp_path / "dest"
    pull(store, str(dest))
    outside = tmp_path / "outside.json"
    outside.write_bytes((dest / "config.json").read_bytes())
    os.unlink(dest / "config.json")
    os.symlink(outside, dest / "config.json")
    verify = deltafs("verify", store, "--local", dest)
    assert verify.returncode == 6 and "config.json is not a regular file" in verify.stdout, verify.stdout
    proc = deltafs("pull", store, dest, check=0)
    assert "repaired" in proc.stdout
    assert not os.path.islink(dest / "config.json") and os.path.isfile(dest / "config.json")
    assert deltafs("pull", store, dest, "--once").returncode == 100  # repaired for good: current
    outside.write_bytes(b"{}")
    assert files_of(dest) == files_of(src)
    assert deltafs("verify", store, "--local", dest).returncode == 0


def _dest_with_tok_linked_outside(tmp_path, maker):  # type: ignore[no-untyped-def]
    """A version with tok/t.json pulled into DEST, whose tok/ is then a symlink to a copy outside DEST (sizes and
    mtimes kept): (store, source, DEST, the outside copy)."""
    import shutil

    store = str(tmp_path / "store")
    src = maker.write()
    os.makedirs(os.path.join(src, "tok"))
    with open(os.path.join(src, "tok", "t.json"), "w") as fh:
        fh.write('{"vocab": 1}')
    push(store, src)
    dest = tmp_path / "dest"
    pull(store, str(dest))
    served = os.path.realpath(dest)
    outside = tmp_path / "outside"
    shutil.copytree(os.path.join(served, "tok"), outside, copy_function=shutil.copy2)
    shutil.rmtree(os.path.join(served, "tok"))
    os.symlink(outside, os.path.join(served, "tok"))
    return store, src, dest, outside


def test_a_directory_of_dest_replaced_by_a_symlink_is_never_linked_into_a_version(tmp_path, maker):
    """The same through a directory: tok/ of the served version replaced by a symlink to a copy outside DEST. The
    file check looked at the last component only, so the next version hard-linked the outside file (its owner could
    change what DEST serves) and verify --local said ok."""
    import shutil

    store, src, dest, outside = _dest_with_tok_linked_outside(tmp_path, maker)
    verify = deltafs("verify", store, "--local", dest)
    assert verify.returncode == 6 and "tok/t.json is not a regular file in" in verify.stdout, verify.stdout
    maker.advance()
    src2 = maker.write("b")
    shutil.copytree(os.path.join(src, "tok"), os.path.join(src2, "tok"))
    push(store, src2)
    pull(store, str(dest))
    new = os.path.join(os.path.realpath(dest), "tok", "t.json")
    assert not os.path.islink(os.path.dirname(new))
    assert os.stat(new).st_ino != os.stat(outside / "t.json").st_ino
    assert deltafs("verify", store, "--local", dest).returncode == 0


def test_the_quick_check_of_dest_notices_a_symlinked_directory(tmp_path, maker):
    """`pull --once` checks the current version by sizes and mtimes: a directory replaced by a symlink to a copy
    with the same sizes and mtimes passed it, and DEST served files outside it until a newer version came."""
    store, src, dest, outside = _dest_with_tok_linked_outside(tmp_path, maker)
    proc = deltafs("pull", store, dest, "--once")
    assert proc.returncode == 0 and "repaired" in proc.stdout, (proc.returncode, proc.stdout, proc.stderr)
    assert not os.path.islink(os.path.join(os.path.realpath(dest), "tok"))
    assert deltafs("pull", store, dest, "--once").returncode == 100


def test_a_candidate_that_fails_its_checks_gives_way_to_the_next(tmp_path, maker):
    """DEST's files are linked by digest; the first file with the right digest failing its checks (here a symlink)
    sent the file to the store, although another file of DEST had the same bytes in place."""
    store = str(tmp_path / "store")
    src = maker.write()
    for name in ("a.bin", "b.bin"):
        with open(os.path.join(src, name), "wb") as fh:
            fh.write(b"\x07" * 300_000)
    push(store, src)
    dest = tmp_path / "dest"
    pull(store, str(dest))
    served = os.path.realpath(dest)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"\x07" * 300_000)
    os.unlink(os.path.join(served, "a.bin"))
    os.symlink(outside, os.path.join(served, "a.bin"))
    maker.advance()
    src2 = maker.write("b")
    for name in ("a.bin", "b.bin"):
        with open(os.path.join(src2, name), "wb") as fh:
            fh.write(b"\x07" * 300_000)
    push(store, src2, full=True, bridge=False)  # the pull starts at this full version and links what DEST holds
    kept = os.stat(os.path.join(served, "b.bin")).st_ino
    pull(store, str(dest))
    now = os.path.realpath(dest)
    assert os.stat(os.path.join(now, "a.bin")).st_ino == kept == os.stat(os.path.join(now, "b.bin")).st_ino
    assert files_of(dest) == files_of(src2)
