"""The examples/ stay true: the orchestrator loop runs, the unit and cron line use real options."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import typer.main
from watch_helpers import same_weights

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")


def test_orchestrator_loop_switches_between_tasks(trainer, tmp_path, engine_server):
    trainer.push()
    trainer.push()
    engine_server.token_delay = 0.05  # a rollout takes a while (8 tokens: 0.4 s)
    proc = subprocess.Popen(
        [sys.executable, os.path.join(EXAMPLES, "orchestrator_loop.py"), trainer.store, str(tmp_path / "dest"),
         "--engine-url", engine_server.url, "--tasks", "6", "--host-id", "orch"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    try:
        for line in proc.stdout:
            task = json.loads(line)
            seen.append(task["weight_version"])
            if task["task"] == 1:
                trainer.push()  # version 3 lands mid-run
        rc = proc.wait(timeout=60)
    finally:
        proc.kill()
    assert rc == 0, proc.stderr.read()
    # Task 0 ran on the engine's original weights while version 2 staged; version 2 went live at
    # the boundary after it. Version 3 landed during task 2, staged at task 3, live from task 4 on.
    assert seen[:3] == ["default", "2", "2"]
    assert seen[-1] == "3" and seen == sorted(seen, key=lambda v: -1 if v == "default" else int(v))
    assert same_weights(engine_server.state_dict(), trainer.weights[3])


def _options(command: str) -> set[str]:
    from deltafs.cli.main import app

    click_app = typer.main.get_command(app)
    cmd = click_app.commands[command]  # type: ignore[attr-defined]
    return {opt for p in cmd.params for opt in p.opts}


def test_systemd_unit_uses_real_watch_options():
    text = open(os.path.join(EXAMPLES, "deltafs-watch@.service")).read()
    exec_start = re.search(r"^ExecStart=(.*?)(?<!\\)$", text, re.MULTILINE | re.DOTALL).group(1)
    used = set(re.findall(r"(--[a-z-]+)", exec_start))
    assert used and used <= _options("watch"), used - _options("watch")


def test_cron_line_uses_real_pull_options():
    line = next(x for x in open(os.path.join(EXAMPLES, "crontab.txt")) if x.startswith("* "))
    used = set(re.findall(r" (--[a-z-]+)", line.split(">>")[0]))
    assert {"--once", "--engine", "--engine-url"} <= used <= _options("pull")


def test_systemd_unit_launch_and_group_notes_use_real_options():
    text = open(os.path.join(EXAMPLES, "deltafs-watch@.service")).read()
    assert "$(deltafs launch-args" in text and "--weight-version" in text
    group = re.search(r"^#\s+(--engine-group .*)$", text, re.MULTILINE).group(1)
    assert set(re.findall(r"(--[a-z-]+)", group)) <= _options("watch")
    from deltafs.cli.main import app

    assert "launch-args" in typer.main.get_command(app).commands  # type: ignore[attr-defined]
