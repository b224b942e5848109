"""Inference-engine adapters behind one small Protocol (base.Engine); the core never imports them.

    make_engine("sglang", "http://127.0.0.1:30000")   -> SGLangEngine (needs the [sglang] extra)
    make_engine("none")                               -> None: pull only, no engine to switch
    reload_engine(...)                                -> one switch, for cron mode (deltafs pull --once)
    TorchModuleEngine(module)                         -> in-process, in place (deltafs.engines.torch_module)
"""

from __future__ import annotations

import logging
from typing import Any

from deltafs.engines.base import Engine, SwitchError, SwitchResult, Target
from deltafs.engines.versions import find_version_dir, weight_version
from deltafs.errors import UsageError

__all__ = [
    "ENGINE_KINDS",
    "Engine",
    "SwitchError",
    "SwitchResult",
    "Target",
    "find_version_dir",
    "make_engine",
    "reload_engine",
    "weight_version",
]

log = logging.getLogger("deltafs.engines")

ENGINE_KINDS = ("sglang", "none")


def make_engine(kind: str, url: str | None = None, **options: Any) -> Engine | None:
    """An engine adapter by name; options go to its constructor (pause_mode, timeout, ...)."""
    if kind == "none":
        return None
    if kind == "sglang":
        if not url:
            raise UsageError("--engine sglang needs --engine-url (e.g. http://127.0.0.1:30000)")
        from deltafs.engines.sglang import SGLangEngine

        return SGLangEngine(url, **options)
    raise UsageError(f"unknown engine {kind!r}; use one of {', '.join(ENGINE_KINDS)}")


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
    engine.resume()  # a cron run killed mid-switch may have left it paused
    wanted = weight_version(version)
    served = engine.served_version()
    if served == wanted:
        return None
    previous = None
    if previous_path is not None and previous_version is not None:
        previous = Target(previous_path, weight_version(previous_version))
    elif dest is not None and served is not None:
        found = find_version_dir(dest, served)
        previous = Target(found, served) if found else None
    result = engine.switch(Target(path, wanted), previous)
    log.info("engine %s now serves version %s (paused %.3fs)", url, wanted, result.pause_seconds)
    return result
