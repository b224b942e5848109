"""The Python API with the in-process torch engine: a trainer-side evaluator or a colocated rollout model."""

from __future__ import annotations

import threading

import pytest
from sglang_standin import build_model
from watch_helpers import CONFIG, same_weights

from deltafs.engines.torch_module import TorchModuleEngine
from deltafs.errors import StoreNotFoundError
from deltafs.watch import Subscriber


def test_poll_then_apply_updates_the_module_in_place(trainer, tmp_path):
    module = build_model(CONFIG)
    param = module.lm_head.weight  # the same Parameter object must be updated, not replaced
    lock = threading.Lock()
    sub = Subscriber(trainer.store, str(tmp_path / "dest"), TorchModuleEngine(module, lock=lock), host_id="eval")
    sub.start()
    with pytest.raises(StoreNotFoundError):  # nothing pushed yet: no store
        sub.poll()
    trainer.push()
    staged = sub.poll()
    assert staged.version == 1
    applied = sub.apply()
    assert applied.version == 1 and sub.apply() is None  # nothing staged any more
    trainer.push()
    trainer.push()
    assert sub.poll().version == 3
    sub.apply()
    assert module.lm_head.weight is param
    assert same_weights(module.state_dict(), trainer.weights[3])
    assert sub.status.served_version == 3 and sub.status.last_sync["version"] == 3
    sub.close()


def test_pull_only_watcher_keeps_dest_current(trainer, tmp_path):
    from deltafs.read.pull import local_version

    trainer.push()
    dest = str(tmp_path / "dest")
    sub = Subscriber(trainer.store, dest, None, host_id="pull-only")
    sub.start()
    assert sub.sync() is not None and local_version(dest).version == 1
    trainer.push()
    applied = sub.sync()
    assert applied.version == 2 and applied.pause_seconds == 0
    assert local_version(dest).version == 2 and sub.status.served_version == 2
    assert sub.sync() is None
    sub.close()
