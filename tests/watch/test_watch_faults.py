"""Bad input under a running watcher: clear errors, no crash, no partial load, recovery when the fault clears."""

from __future__ import annotations

import os
import shutil

import pytest

from watch_helpers import FAST, running, same_weights, wait_until

from deltafs.engines.sglang import SGLangEngine
from deltafs.format.manifest import Head
from deltafs.store.open import open_objects
from deltafs.store.repo import HEAD_KEY, Repository
from deltafs.watch import Subscriber
from deltafs.watch.ledger import HostStatus, ledger_key


def make(trainer, tmp_path, server) -> Subscriber:
    return Subscriber(trainer.store, str(tmp_path / "dest"), SGLangEngine(server.url, timeout=2, load_timeout=5),
                      host_id="rollout-0", **FAST)


def ledger(trainer) -> HostStatus:
    return HostStatus.from_bytes(open_objects(trainer.store).get(ledger_key("rollout-0")))


def served(trainer, version: int) -> bool:
    try:
        st = ledger(trainer)
    except FileNotFoundError:
        return False
    return st.served_version == version and st.state == "serving"


def degraded_with(trainer, text: str) -> bool:
    try:
        st = ledger(trainer)
    except FileNotFoundError:
        return False
    return st.failures >= 2 and st.state == "degraded" and text in (st.last_error or "")


def chunks_only_in(store: str, version: int) -> list[str]:
    repo = Repository.open(store)
    mine = {c.object for f in repo.manifest(version).files for s in f.segments for c in s.chunks if c.object}
    others = {c.object for v in repo.versions() if v != version
              for f in repo.manifest(v).files for s in f.segments for c in s.chunks if c.object}
    return sorted(mine - others)


def test_store_disappears_and_comes_back(trainer, tmp_path, engine_server):
    trainer.push()
    sub = make(trainer, tmp_path, engine_server)
    with running(sub) as thread:
        wait_until(lambda: served(trainer, 1))
        moved = trainer.store + ".away"
        os.rename(trainer.store, moved)
        wait_until(lambda: sub.status.failures >= 2, what="failures while the store is gone")
        assert "disappeared" in sub.status.last_error or "no deltafs store" in sub.status.last_error
        assert engine_server.weight_version == "1" and not engine_server.paused
        os.rename(moved, trainer.store)
        trainer.push()
        wait_until(lambda: served(trainer, 2), what="recovery")
        assert thread.is_alive()
    assert same_weights(engine_server.state_dict(), trainer.weights[2])


def test_head_pointing_at_a_missing_manifest(trainer, tmp_path, engine_server):
    trainer.push()
    trainer.push()
    objects = open_objects(trainer.store)
    good_head = objects.get(HEAD_KEY)
    objects.put(HEAD_KEY, Head(99, "sha256:" + "0" * 64).to_bytes())
    sub = make(trainer, tmp_path, engine_server)
    with running(sub):
        # Version 99 does not exist: the newest listed version that verifies is served instead.
        wait_until(lambda: degraded_with(trainer, "version 99"), what="loud failure about version 99")
        assert engine_server.weight_version == "2"
        objects.put(HEAD_KEY, good_head)
        wait_until(lambda: served(trainer, 2) and ledger(trainer).failures == 0, what="recovery")
    assert same_weights(engine_server.state_dict(), trainer.weights[2])


def test_corrupted_chunk_is_never_loaded(trainer, tmp_path, engine_server):
    trainer.push()
    with running(make(trainer, tmp_path, engine_server)):
        wait_until(lambda: served(trainer, 1))
    # Version 2 lands with a bad chunk while no watcher runs; a restarted watcher finds it.
    trainer.push()
    victims = chunks_only_in(trainer.store, 2)
    assert victims
    path = os.path.join(trainer.store, "chunks", victims[0][:2], victims[0])
    good = open(path, "rb").read()
    open(path, "wb").write(b"\x00" * len(good))
    updates = engine_server.count("update")
    sub = make(trainer, tmp_path, engine_server)
    with running(sub) as thread:
        wait_until(lambda: degraded_with(trainer, "verified"), what="loud failure")
        assert engine_server.count("update") == updates  # nothing unverified went to the engine
        assert engine_server.weight_version == "1" and not engine_server.paused
        assert same_weights(engine_server.state_dict(), trainer.weights[1])
        assert ledger(trainer).served_version == 1  # the restarted watcher knows what the engine serves
        open(path, "wb").write(good)
        wait_until(lambda: served(trainer, 2), what="recovery once the chunk is good again")
        assert thread.is_alive()
    assert same_weights(engine_server.state_dict(), trainer.weights[2])


def test_dest_deleted_under_the_watcher(trainer, tmp_path, engine_server):
    trainer.push()
    sub = make(trainer, tmp_path, engine_server)
    dest = str(tmp_path / "dest")
    with running(sub):
        wait_until(lambda: served(trainer, 1))
        os.unlink(dest)
        shutil.rmtree(dest + ".deltafs")
        trainer.push()
        wait_until(lambda: served(trainer, 2), what="version 2 rebuilt from a full version")
    assert same_weights(engine_server.state_dict(), trainer.weights[2])
    assert os.path.islink(dest)
    assert ledger(trainer).last_sync["version"] == 2


def test_dest_of_another_store_is_replaced_from_a_full_version(trainer, tmp_path, engine_server):
    from watch_helpers import CONFIG

    from deltafs.publish import push_tensors
    from deltafs.read.pull import pull

    other = str(tmp_path / "other-store")
    push_tensors(other, trainer._current, cache_dir=str(tmp_path / "other-cache"))
    pull(other, str(tmp_path / "dest"))
    trainer.push()
    sub = make(trainer, tmp_path, engine_server)
    sub.start()
    applied = sub.sync()
    assert applied is not None and applied.version == 1
    assert same_weights(engine_server.state_dict(), trainer.weights[1])
    assert CONFIG  # the store's checkpoint, with its config.json, is what DEST holds now
    assert os.path.exists(os.path.join(str(tmp_path / "dest"), "config.json"))


def _serving_an_old_runs_version_3(tmp_path):
    """(store, dest, the old run's trainer, a pull-only watcher that serves its version 3)."""
    from watch_helpers import Trainer

    store, dest = str(tmp_path / "store"), str(tmp_path / "dest")
    old = Trainer(store, str(tmp_path / "cache-old"))
    for _ in range(3):
        old.push()
    sub = Subscriber(store, dest, None, host_id="pull-only", **FAST)
    sub.start()
    assert sub.sync().version == 3
    return store, dest, old, sub


@pytest.mark.parametrize("new_versions, seen_gone", [(2, True), (4, False)])
def test_a_store_made_again_at_the_same_url_replaces_the_old_runs_checkpoint(tmp_path, new_versions, seen_gone):
    """A store deleted and pushed again (a new run) starts at version 1: the watcher kept serving the old run's
    version 3, newer by number only, logged it healthy and status showed a lag of -1 (adversarial pass). When no
    poll saw the store gone and the new run is past version 3 already, the watcher kept its open store and failed
    every cycle on "manifest of version 4 belongs to store X, not Y" until restarted (a later pass): a manifest of
    another store makes it open the store afresh at once."""
    from deltafs.read.pull import local_version
    from watch_helpers import Trainer

    store, dest, old, sub = _serving_an_old_runs_version_3(tmp_path)
    shutil.rmtree(store)
    new = Trainer(store, str(tmp_path / "cache-new"))
    for _ in range(new_versions):
        new.push()
    if seen_gone:
        sub._forget_store()  # as after the store failed while it was gone
    applied = sub.sync()
    assert applied is not None and applied.version == new_versions
    state = local_version(dest)
    assert state.version == new_versions and state.store_id == Repository.open(store).store_id
    assert sub.status.served_version == new_versions and sub.status.store_id == state.store_id
    sub.close()


def test_a_dest_disk_for_two_versions_still_takes_updates(tmp_path, monkeypatch):
    """The watcher keeps three versions; where the third does not fit (ENOSPC) it pulls again keeping two, as pull
    does by default (it failed every retry, and called the full disk an integrity failure, exit 6)."""
    import errno as errno_mod

    import deltafs.watch.subscriber as subscriber
    from deltafs.errors import LocalWriteError
    from watch_helpers import Trainer

    store, dest = str(tmp_path / "store"), str(tmp_path / "dest")
    trainer = Trainer(store, str(tmp_path / "cache"))
    trainer.push()
    sub = Subscriber(store, dest, None, host_id="pull-only", **FAST)
    sub.start()
    assert sub.sync().version == 1
    real = subscriber.pull
    keeps = []

    def small_disk(repo, dest, **kw):
        keeps.append(kw["keep"])
        if kw["keep"] > 2:
            err = LocalWriteError(f"cannot write {dest}: No space left on device")
            err.errno = errno_mod.ENOSPC
            raise err
        return real(repo, dest, **kw)

    monkeypatch.setattr(subscriber, "pull", small_disk)
    trainer.push()
    assert sub.sync().version == 2 and keeps == [3, 2]
    monkeypatch.setattr(subscriber, "pull", lambda *a, **k: (_ for _ in ()).throw(
        LocalWriteError("cannot write x: Read-only file system")))
    trainer.push()
    try:
        sub.sync()
        raise AssertionError("a DEST that cannot be written must fail the sync")
    except LocalWriteError as exc:  # its own exit code (12), not an integrity failure of the version (6)
        from deltafs.errors import exit_code
        assert exit_code(exc) == 12
    sub.close()


def test_the_watcher_never_switches_while_another_process_switches_the_same_engine(trainer, tmp_path, engine_server):
    """A cron `pull --once --engine` (reload_engine, which holds DEST's engine.lock) and a watcher on one DEST and
    engine sent two updates at once, and each one's resume ended the other's pause mid-load (adversarial pass)."""
    import pytest

    from deltafs.errors import LockHeldError
    from deltafs.read.dest import LocalCheckpoint

    trainer.push()
    sub = make(trainer, tmp_path, engine_server)
    sub.start()
    assert sub.sync().version == 1
    trainer.push()
    assert sub.poll().version == 2
    updates = engine_server.updates if hasattr(engine_server, "updates") else None
    with LocalCheckpoint(sub.dest).lock(wait=False, name="engine.lock"):  # the cron run's switch
        with pytest.raises(LockHeldError):
            sub.apply()
        assert engine_server.weight_version == "1"
        assert updates is None or engine_server.updates == updates
        engine_server.paused = True  # the cron run paused it for its load: a restarting watcher must not resume
        sub.start()
        assert engine_server.paused
        engine_server.paused = False
    assert sub.apply().version == 2 and engine_server.weight_version == "2"
    sub.close()


def test_a_watcher_restarted_while_its_killed_switch_still_loads_waits_for_that_load(trainer, tmp_path, engine_server):
    """A watcher SIGKILLed during a slow load and restarted at once (Restart=on-failure) resumed the engine and sent
    a second update for the same version while the first was still loading (adversarial pass). The switch leaves
    DEST.deltafs/engine-switch.json while it runs; a starting watcher waits until the engine reports that version
    (or the load's time is up) before it touches the engine."""
    import json
    import threading
    import time

    trainer.push()
    first = make(trainer, tmp_path, engine_server)
    first.start()
    assert first.sync().version == 1
    trainer.push()
    staged = first.poll()
    # What the killed watcher left: the engine paused and loading version 2, the record of that switch.
    record = os.path.join(str(tmp_path / "dest") + ".deltafs", "engine-switch.json")
    with open(record, "w") as fh:
        json.dump({"version": "2", "path": staged.path, "pid": 1, "deadline": time.time() + 20}, fh)
    engine_server.paused = True
    updates, continues = engine_server.count("update"), engine_server.count("continue")

    def load_finishes():
        time.sleep(1.5)
        engine_server.model_path, engine_server.weight_version = staged.path, "2"  # as a finished load sets them

    threading.Thread(target=load_finishes, daemon=True).start()
    t0 = time.monotonic()
    second = make(trainer, tmp_path, engine_server)
    second.start()
    assert time.monotonic() - t0 >= 1.0  # it waited for the load
    assert engine_server.count("update") == updates  # no second update
    assert engine_server.count("continue") == continues + 1 and not engine_server.paused  # resumed after it
    assert not os.path.exists(record) and second.status.served_version == 2
    second.close()
    first.close()


def test_a_store_deleted_while_a_poll_reads_it_is_opened_afresh(tmp_path, monkeypatch):
    """A poll that listed a manifest which the deletion of the store then removed before it was read failed with
    "version 3 is not in STORE", and the watcher kept its open store: the new run's HEAD, below the served number,
    was never read past, and the engine served the old run's version 3 as current, healthy, for as many steps as the
    new run took to pass 3 (adversarial pass, 2 of 5 runs)."""
    import contextlib

    from deltafs.errors import DeltafsError, VersionNotFoundError
    from deltafs.read.pull import local_version
    from watch_helpers import Trainer

    store, dest, old, sub = _serving_an_old_runs_version_3(tmp_path)
    old.push()  # version 4 is listed; the deletion removes it before the poll reads it

    def deleted_meanwhile(version, *a, **k):
        raise VersionNotFoundError(f"version {version} is not in {store}")

    monkeypatch.setattr(sub.repo, "manifest", deleted_meanwhile)
    with contextlib.suppress(DeltafsError):  # this poll fails or stages nothing newer; the next one must see anew
        sub.poll()
    shutil.rmtree(store)
    new = Trainer(store, str(tmp_path / "cache-new"))
    for _ in range(2):
        new.push()
    applied = sub.sync()
    assert applied is not None and applied.version == 2
    assert local_version(dest).store_id == Repository.open(store).store_id
    sub.close()
