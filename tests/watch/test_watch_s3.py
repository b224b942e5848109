"""A watcher on an S3 store (moto's real server on 127.0.0.1): HEAD is polled, the ledger lives in S3."""

from __future__ import annotations

import json

import typer
from deltafs.cli.watch import register
from typer.testing import CliRunner
from watch_helpers import FAST, Trainer, running, same_weights, wait_until

from deltafs.engines.sglang import SGLangEngine
from deltafs.watch import Subscriber


def test_watch_an_s3_store_by_polling(s3_url, s3_options, tmp_path, engine_server):
    trainer = Trainer(s3_url, str(tmp_path / "push-cache"), storage_options=s3_options)
    trainer.push()
    sub = Subscriber(s3_url, str(tmp_path / "dest"), SGLangEngine(engine_server.url), storage_options=s3_options,
                     host_id="s3-host", poll=0.2, **FAST)
    with running(sub):
        wait_until(lambda: engine_server.weight_version == "1", timeout=20)
        assert sub.notifier.mode == "poll"
        trainer.push()
        wait_until(lambda: engine_server.weight_version == "2", timeout=20)
        wait_until(lambda: sub.status.state == "serving")
    assert same_weights(engine_server.state_dict(), trainer.weights[2])

    app = typer.Typer()
    register(app)
    result = CliRunner().invoke(app, ["status", s3_url, "--storage-options", json.dumps(s3_options), "--json"],
                                standalone_mode=False)
    assert result.return_value == 0, result.output
    hosts = json.loads(result.stdout)["hosts"]
    assert [(h["host"]["host_id"], h["host"]["served_version"], h["lag"]) for h in hosts] == [("s3-host", 2, 0)]
