"""Inference-engine adapters behind one small Protocol (base.Engine); the core never imports them.

    make_engine("sglang", "http://127.0.0.1:30000")   -> SGLangEngine (needs the [sglang] extra)
    make_engine("vllm", "http://127.0.0.1:8000")      -> VLLMEngine (needs the [vllm] extra)
    make_engine("other", url)                         -> a third party's engine, by entry point
    make_engine("none")                               -> None: pull only, no engine to switch
    reload_engine(...)                                -> one switch, for cron mode (deltafs pull --once)
    switch_engine(engine, target, previous)           -> the switch both the watcher and reload_engine run
    TorchModuleEngine(module)                         -> in-process, in place (deltafs.engines.torch_module)
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from importlib import import_module, metadata
from typing import Any

from deltafs.engines.base import Engine, NeedsRestartError, SwitchError, SwitchResult, Target
from deltafs.engines.inflight import SwitchRecord
from deltafs.engines.switch import current_target, same_checkpoint, switch_engine
from deltafs.engines.versions import find_version_dir, weight_version
from deltafs.errors import UsageError

__all__ = [
    "ENGINE_KINDS",
    "Engine",
    "NeedsRestartError",
    "SwitchError",
    "SwitchResult",
    "Target",
    "current_target",
    "engine_kinds",
    "find_version_dir",
    "make_engine",
    "reload_engine",
    "switch_engine",
    "weight_version",
]

log = logging.getLogger("deltafs.engines")

ENGINE_KINDS = ("sglang", "vllm", "none")
# Built-in adapters: kind -> (module, class, example URL). Imported only when asked for.
BUILTIN_ENGINES = {
    "sglang": ("deltafs.engines.sglang", "SGLangEngine", "http://127.0.0.1:30000"),
    "vllm": ("deltafs.engines.vllm", "VLLMEngine", "http://127.0.0.1:8000"),
}
# Third-party adapters register a factory, called as factory(url, **options) -> Engine, e.g.
#   [project.entry-points."deltafs.engines"]  myengine = "mypkg.deltafs_engine:MyEngine"
ENTRY_POINT_GROUP = "deltafs.engines"


def engine_kinds() -> list[str]:
    """Every --engine name usable here: the built-in ones, those installed packages register, "none"."""
    plugins = {ep.name for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    return [*BUILTIN_ENGINES, *sorted(plugins - set(BUILTIN_ENGINES)), "none"]


def make_engine(kind: str, url: str | None = None, **options: Any) -> Engine | None:
    """An engine adapter by name: a built-in one, else one registered under the deltafs.engines entry points.

    options go to its constructor (pause_mode, load_timeout, api_key, ...). SGLang's two keys default to
    $DELTAFS_ENGINE_API_KEY and $DELTAFS_ENGINE_ADMIN_API_KEY (never flags: flags show up in ps).
    """
    if kind == "none":
        return None
    if kind in BUILTIN_ENGINES:
        module, name, example = BUILTIN_ENGINES[kind]
        if not url:
            raise UsageError(f"--engine {kind} needs --engine-url (e.g. {example})")
        if kind == "sglang":
            from deltafs.engines.sglang import ADMIN_API_KEY_ENV, API_KEY_ENV

            options["api_key"] = options.get("api_key") or os.environ.get(API_KEY_ENV)
            options["admin_api_key"] = options.get("admin_api_key") or os.environ.get(ADMIN_API_KEY_ENV)
        adapter: Callable[..., Engine] = getattr(import_module(module), name)
        return adapter(url, **options)
    plugins = {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    if kind not in plugins:
        raise UsageError(f"unknown engine {kind!r}; use one of {', '.join(engine_kinds())}")
    try:
        factory = plugins[kind].load()
    except Exception as exc:  # a broken third-party package: say which one, in one line
        raise UsageError(f"engine {kind!r} ({plugins[kind].value}) cannot be loaded: {exc}") from None
    engine = factory(url, **options)
    if not isinstance(engine, Engine):
        raise UsageError(f"engine {kind!r} ({plugins[kind].value}) did not return an Engine "
                         "(kind, served_version, busy_requests, resume, switch)")
    return engine


def reload_engine(kind: str, url: str | None, path: str | None = None, version: int | None = None, *,
                  dest: str | None = None, previous_path: str | None = None, previous_version: int | None = None,
                  **options: Any) -> SwitchResult | None:
    """Switch an engine to a verified checkpoint, unless it already reports that version.

    Give either path and version (a version directory pull returned), or dest (the version DEST
    points to now). Idempotent, so cron mode can call it on every run, "already current" ones
    included: a run whose pull succeeded but whose reload failed is repaired by the next run.
    Without previous_path, the rollback target is the local version directory of what the engine
    reports now, if pull kept it. Returns None when nothing was switched; raises SwitchError (after
    the rollback) or EngineError when the engine cannot be reached.
    """
    from deltafs.errors import DestinationError

    if dest is not None:
        from deltafs.read.dest import LocalCheckpoint

        state = LocalCheckpoint(dest).state()
        if state is None:
            raise DestinationError(f"{dest} holds no verified deltafs version to load")
        if version is not None and version != state.version:
            raise UsageError(f"{dest} holds version {state.version}, not {version}")
        path, version = state.path, state.version
    if path is None or version is None:
        raise UsageError("reload_engine needs path and version, or dest")
    engine = make_engine(kind, url, **options)
    if engine is None:
        return None
    if dest is None:
        return _reload(engine, url, path, version, dest, previous_path, previous_version)
    from deltafs.read.dest import LocalCheckpoint

    # One switch per DEST at a time: a cron run still waiting for a slow load must not be joined by the
    # next run's update (SGLang cannot take two at once). A switch killed mid-load (a watcher's or a cron run's)
    # left its record: its load may still run, so nothing is resumed or sent before it ends.
    with LocalCheckpoint(dest).lock(wait=False, name="engine.lock"):
        record = SwitchRecord(dest)
        record.wait_for_killed(engine)
        return _reload(engine, url, path, version, dest, previous_path, previous_version, record)


def _reload(engine: Engine, url: str | None, path: str, version: int, dest: str | None, previous_path: str | None,
            previous_version: int | None, record: SwitchRecord | None = None) -> SwitchResult | None:
    engine.resume()  # a run killed mid-switch may have left it paused
    wanted = weight_version(version)
    target = Target(path, wanted)
    if dest is None:
        if engine.served_version() == wanted:
            return None
        served = None
    else:
        # The number alone is not enough: a new run's version 1 is not the old run's (current_target). DEST was
        # just pulled: a model_path of DEST itself says nothing about what the engine holds.
        served = current_target(engine, dest)
        if same_checkpoint(served, target):
            return None
    previous = served
    if previous_path is not None and previous_version is not None:
        previous = Target(previous_path, weight_version(previous_version))
    with record.around(engine, target) if record is not None else contextlib.nullcontext():
        result = switch_engine(engine, target, previous)
    log.info("engine %s now serves version %s (paused %.3fs)", url, wanted, result.pause_seconds)
    return result
