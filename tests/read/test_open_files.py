"""A version of more files than the process may hold open pulls: files are open only while their chunks are written."""

from __future__ import annotations

import filecmp
import os
import resource
import subprocess
import sys

MAIN = "import sys; from deltafs.cli.main import main; sys.argv[0] = 'deltafs'; main()"


def _deltafs(*args: str, nofile: int) -> subprocess.CompletedProcess:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    return subprocess.run([sys.executable, "-c", MAIN, *args], capture_output=True, text=True, timeout=300,
                          preexec_fn=limit)


def test_a_version_of_more_files_than_the_open_file_limit_pulls(tmp_path):
    """1,500 small files under `ulimit -n 256` (many hosts default to 1024): pull opened every file of the version
    before writing any, failed with EMFILE, and said "No such file or directory", exit 1 (adversarial pass)."""
    src, store, dest = tmp_path / "src", str(tmp_path / "store"), str(tmp_path / "dest")
    src.mkdir()
    for i in range(1500):
        (src / f"f{i}.txt").write_text(f"file {i}\n")
    assert _deltafs("push", str(src), store, "-q", nofile=256).returncode == 0
    first = _deltafs("pull", store, dest, "-q", nofile=256)
    assert first.returncode == 0, first.stderr
    for i in range(0, 1500, 7):  # an update: files rewritten in the recycled directory, the rest linked
        (src / f"f{i}.txt").write_text(f"file {i}, step 2\n")
    assert _deltafs("push", str(src), store, "-q", nofile=256).returncode == 0
    second = _deltafs("pull", store, dest, "-q", nofile=256)
    assert second.returncode == 0, second.stderr
    names = sorted(os.listdir(src))
    assert sorted(os.listdir(dest)) == names
    match, mismatch, errors = filecmp.cmpfiles(src, dest, names, shallow=False)
    assert not mismatch and not errors



def test_a_file_replaced_in_staging_before_its_bytes_are_written_fails_the_pull(tmp_path, monkeypatch):
    """Files are reopened by name for their writes: one put in place of the file pull made (a planted name) must fail
    the pull, never receive the version's bytes, and nothing is installed."""
    import pytest

    from deltafs.errors import DestinationError
    from deltafs.publish import push
    from deltafs.read import rebuild
    from deltafs.read.pull import pull

    src, store, dest = tmp_path / "src", str(tmp_path / "store"), str(tmp_path / "dest")
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(1 << 16))
    push(store, str(src))
    real = rebuild.Builder._open_out
    planted = tmp_path / "planted"

    def made_then_replaced(self, f, out_dir):
        out = real(self, f, out_dir)
        os.unlink(out.path)
        planted.write_bytes(b"")
        os.link(planted, out.path)  # another file under the same name
        return out

    monkeypatch.setattr(rebuild.Builder, "_open_out", made_then_replaced)
    with pytest.raises(DestinationError, match="was replaced"):
        pull(store, dest)
    assert planted.read_bytes() == b"" and not os.path.lexists(dest)


def test_an_interrupted_pull_stops_its_workers_before_closing_their_files(tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM (now every one-shot command's, as exit 130) in the main thread closed every file's
    descriptor while the rebuild's workers still wrote through them: a number the cleanup had reopened for another
    file could receive a chunk (review). The workers are stopped and waited for first."""
    import signal
    import threading
    import time

    import pytest

    from deltafs.publish import push
    from deltafs.read import rebuild
    from deltafs.read.pull import pull

    src, store, dest = tmp_path / "src", str(tmp_path / "store"), str(tmp_path / "dest")
    src.mkdir()
    for i in range(8):
        (src / f"f{i}.bin").write_bytes(os.urandom(1 << 16))
    push(store, str(src))
    real = rebuild.Builder._run_bytes
    signalled = threading.Event()

    def slow(self, run, buf):
        # The first run a worker takes interrupts the main thread, then keeps the worker busy: the signal lands
        # while workers hold the files open, however loaded the machine (a timer did not, once, under load).
        if not signalled.is_set():
            signalled.set()
            os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.3)
        return real(self, run, buf)

    monkeypatch.setattr(rebuild.Builder, "_run_bytes", slow)
    with pytest.raises(KeyboardInterrupt):
        pull(store, dest, threads=2)
    assert signalled.is_set()
    assert not [t for t in threading.enumerate() if t.name.startswith("deltafs-pull-")]
    assert not os.path.lexists(dest)
