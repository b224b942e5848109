"""The one engine switch, used by the watcher (Subscriber.apply) and by cron mode (reload_engine).

    current = current_target(engine, dest)           # what the engine serves, as a verified local version
    result = switch_engine(engine, target, current)  # refuse what needs a restart, switch, checksum
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os

from deltafs.buffers import aligned_empty
from deltafs.engines.base import Engine, NeedsRestartError, SwitchResult, Target
from deltafs.engines.compat import restart_reason
from deltafs.engines.versions import labelled_version_dirs, read_version_manifest, weight_version
from deltafs.errors import EngineError, FormatError
from deltafs.read.dest import LocalCheckpoint

log = logging.getLogger("deltafs.engines")

# An engine's loaded-weight checksum longer than this is kept as the sha256 of its text (see loaded_checksum).
CHECKSUM_MAX_CHARS = 1024


def switch_engine(engine: Engine, target: Target, previous: Target | None, *, warm: bool = True) -> SwitchResult:
    """Switch engine to target (rolling back to previous on failure) and read its loaded-weight checksum.

    Raises NeedsRestartError, before touching the engine, when target changes more than weights
    compared with previous (config, tokenizer, tensor names or shapes): a hot switch would serve the
    new tensors under the old config, or keep old values for tensors the new version lacks.
    warm=False: the caller has just read the files whole (a full check), so the page cache holds them.
    """
    reason = restart_needed(previous.path, target.path) if previous is not None else None
    if reason is not None:
        raise NeedsRestartError(target.version, reason)
    if warm and getattr(engine, "loads_from_disk", False):
        warm_page_cache(target.path)  # outside the pause: the engine's own loader then reads from memory
    result = engine.switch(target, previous)
    return dataclasses.replace(result, checksum=loaded_checksum(engine))


def restart_needed(previous: str, target: str) -> str | None:
    """Why loading version directory `target` over `previous` needs an engine restart (restart_reason), or None; also
    None when `previous` is gone, before or during the comparison: another process's cleanup (a cron run beside a
    watcher) renames a version away at once, its files then read as missing, and that says nothing about target."""
    if not os.path.isdir(previous):
        return None
    reason = restart_reason(previous, target)
    return reason if reason is None or os.path.isdir(previous) else None


def warm_page_cache(path: str, *, block: int = 8 << 20) -> int:
    """Read every file under path once so the page cache holds it; the bytes read.

    SGLang's update_weights_from_disk and vLLM's reload_weights re-read the whole checkpoint while
    generation is paused; files just rebuilt by a pull are usually cached already, but files linked
    from the previous version (and anything evicted since) are not. Best effort: errors are ignored.
    """
    total = 0
    view = aligned_empty(block).data  # page-aligned: the kernel's copy into it is up to 4x faster
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            except OSError:
                continue
            try:
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                with open(fd, "rb", buffering=0, closefd=False) as fh:
                    while n := fh.readinto(view):
                        total += n
            except OSError:
                pass
            finally:
                os.close(fd)
    return total


def loaded_checksum(engine: Engine) -> str | None:
    """The engine's checksum of its loaded weights, where it has one (SGLang's /weights_checker)."""
    ask = getattr(engine, "loaded_checksum", None)
    if ask is None:
        return None
    try:
        value = ask()
    except EngineError as exc:
        log.warning("cannot read the loaded-weight checksum: %s", exc)
        return None
    text = str(value) if value else None
    if text is not None and len(text) > CHECKSUM_MAX_CHARS:
        # The ledger keeps it and rewrites it at every heartbeat: an engine answering megabytes must not make the
        # host's fleet record unreadable (its size limit) or grow the store. The digest compares alike.
        text = "sha256:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    return text


def current_target(engine: Engine, dest: str, *, trust_dest_link: bool = False,
                   answer: tuple[str | None, str | None] | None = None) -> Target | None:
    """What the engine serves, as a verified version directory beside DEST; None if unknown.

    From the weight_version it reports; when that is not a version DEST has (SGLang says "default"
    when started without --weight-version), from the model_path it loaded. A model_path that is
    DEST itself names whatever DEST pointed to when the engine loaded it, which is the version DEST
    points to now only if nothing was pulled since: pass trust_dest_link only then.

    The number is believed only together with the model_path, where the engine reports one: a
    model_path naming another directory than the number's (another of DEST's, perhaps removed since;
    one outside DEST, an engine restarted by hand from other weights under the same label) means the
    weights are not known to be that version (None), and a number DEST holds from two stores (a store
    made again by a new run) is decided by the model_path, or unknown without one. Loading again costs
    a pause; trusting the number would keep other weights, reported as the version, for good.

    answer: what engine_answer() just returned, when the caller has it (not asked again).
    """
    reported, path = answer if answer is not None else engine_answer(engine)
    local = LocalCheckpoint(dest)
    at_dest = bool(path) and os.path.abspath(str(path)).rstrip("/") == local.dest
    labelled = labelled_version_dirs(dest, reported) if reported is not None else []
    if labelled:
        if path and not at_dest:
            # The directory it loaded decides. Another than the number's (another of DEST's, the old run's perhaps
            # removed since; one outside DEST, a restart by hand from other weights under the same label): unknown.
            real = os.path.realpath(path)
            return next((Target(found, weight_version(manifest.version)) for found, manifest in labelled
                         if os.path.realpath(found) == real), None)
        one_store = len({manifest.store_id for _, manifest in labelled}) == 1
        return Target(labelled[0][0], weight_version(labelled[0][1].version)) if one_store else None
    if not path:
        return None
    if at_dest:
        state = local.state() if trust_dest_link else None
        return Target(state.path, weight_version(state.version)) if state else None
    real = os.path.realpath(path)
    for candidate in local.version_dirs():
        if os.path.realpath(candidate) == real:
            try:
                return Target(candidate, weight_version(read_version_manifest(candidate).version))
            except FormatError:
                return None
    return None


def engine_answer(engine: Engine) -> tuple[str | None, str | None]:
    """What the engine says it serves: its weight_version, and the directory it loaded where it says (SGLang's
    model_path)."""
    ask = getattr(engine, "served_path", None)
    return engine.served_version(), (ask() if ask is not None else None)


def served_elsewhere(engine: Engine, dest: str) -> str | None:
    """The version directory beside DEST that the engine serves when DEST points elsewhere (a reload that failed, an
    engine behind), else None; also None when the engine cannot be asked. A pull must keep it: the switch checks
    against it whether the new version needs a restart, and rolls back to it. Its mtime is renewed, so the cleanup,
    which keeps the newest, counts it among them."""
    try:
        served = current_target(engine, dest)
    except EngineError:
        return None
    local = LocalCheckpoint(dest)
    if served is None or os.path.basename(served.path) == local.linked_name():
        return None
    try:
        os.utime(served.path)
    except OSError:
        return None
    return served.path


def same_checkpoint(served: Target | None, target: Target) -> bool:
    """Whether the version directory an engine serves (current_target) is `target`: the same version of the same
    store (equal manifests), not merely the same number."""
    if served is None or served.version != target.version:
        return False
    try:
        return read_version_manifest(served.path).digest == read_version_manifest(target.path).digest
    except FormatError:
        return False
