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
from deltafs.errors import UsageError

__all__ = ["Engine", "SwitchError", "SwitchResult", "Target", "ENGINE_KINDS", "make_engine", "reload_engine", "weight_version"]

log = logging.getLogger("deltafs.engines")

ENGINE_KINDS = ("sglang", "none")


def weight_version(version: int) -> str:
    """The weight_version string an engine reports for a deltafs version (its number)."""
    return str(int(version))


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


def reload_engine(kind: str, url: str | None, path: str, version: int, *, previous_path: str | None = None,
                  previous_version: int | None = None, **options: Any) -> SwitchResult | None:
    """Switch an engine to the verified checkpoint at path, unless it already reports `version`.

    Idempotent, so cron mode can call it on every run, including "already current" ones (a run
    whose pull succeeded but whose reload failed is then repaired by the next run). Returns None
    when nothing was switched; raises SwitchError (after rolling back to previous_path when given)
    or EngineError when the engine cannot be reached.
    """
    engine = make_engine(kind, url, **options)
    if engine is None:
        return None
    wanted = weight_version(version)
    if engine.served_version() == wanted:
        return None
    previous = None
    if previous_path is not None and previous_version is not None:
        previous = Target(previous_path, weight_version(previous_version))
    result = engine.switch(Target(path, wanted), previous)
    log.info("engine %s now serves version %s (paused %.3fs)", url, wanted, result.pause_seconds)
    return result
