"""How the watcher learns about new versions: inotify where events arrive, polling elsewhere."""

from __future__ import annotations

import threading
import time

from deltafs.store.open import open_objects
from deltafs.watch.notify import NO_EVENTS_FS, Notifier, jittered, mount_fstype


def test_network_mounts_are_recognized(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    mounts = "\n".join([
        "/dev/sda1 / ext4 rw 0 0",
        f"server:/export {tmp_path} nfs4 rw,relatime 0 0",
        f"fuse-thing {tmp_path}/other fuse.s3fs rw 0 0",
    ])
    assert mount_fstype(str(store), mounts) == "nfs4"
    assert mount_fstype(str(tmp_path / "not-yet" / "store"), mounts) == "nfs4"  # judged by the parent
    assert mount_fstype("/", mounts) == "ext4"
    assert "nfs4".startswith(NO_EVENTS_FS) and "fuse.s3fs".startswith(NO_EVENTS_FS)
    assert not "ext4".startswith(NO_EVENTS_FS)


def test_local_store_gets_file_events(tmp_path):
    (tmp_path / "manifests").mkdir()
    notifier = Notifier(open_objects(str(tmp_path)))
    try:
        assert notifier.mode == "inotify"
        threading.Timer(0.1, lambda: (tmp_path / "HEAD").write_text("x")).start()
        started = time.monotonic()
        assert notifier.wait(5.0)  # woken by the event, not the timeout
        assert time.monotonic() - started < 4.5
    finally:
        notifier.close()


def test_poll_option_and_remote_stores_poll(tmp_path):
    assert Notifier(open_objects(str(tmp_path)), poll=0.5).mode == "poll"
    remote = Notifier(open_objects("memory://deltafs-notify-test"))
    assert remote.mode == "poll" and remote.interval == 5.0
    assert not remote.wait(0.05)


def test_jitter_spreads_the_interval():
    values = {round(jittered(10.0), 3) for _ in range(50)}
    assert len(values) > 10 and all(8.0 <= v <= 12.0 for v in values)
