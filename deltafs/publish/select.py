"""Which files under SRC a push publishes: default ignores plus hf-style --include/--exclude globs."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
import json
import os

from deltafs.errors import SourceError

# Never model weights: caches and locks of `hf download --local-dir`, version control, deltafs's own
# folders, and trainer state that is not served (optimizer, scheduler, RNG, trainer bookkeeping).
DEFAULT_EXCLUDES: tuple[str, ...] = (
    ".cache/*",
    ".git/*",
    "*.deltafs/*",
    "*.lock",
    "*.tmp",
    ".tmp-*",
    "__pycache__/*",
    ".DS_Store",
    "optimizer.pt",
    "optimizer.bin",
    "optimizer_*.pt",
    "scheduler.pt",
    "scaler.pt",
    "rng_state*.pth",
    "trainer_state.json",
    "training_args.bin",
    "global_step*/*",
)


def _match(rel: str, pattern: str) -> bool:
    """hf-style glob: '*' crosses '/', a pattern without '/' also matches a base name, 'dir/' a folder."""
    if pattern.endswith("/"):
        pattern += "*"
    if fnmatch.fnmatchcase(rel, pattern):
        return True
    if "/" not in pattern and fnmatch.fnmatchcase(rel.rsplit("/", 1)[-1], pattern):
        return True
    # a folder pattern such as ".cache/*" also matches that folder at any depth
    return pattern.endswith("/*") and any(fnmatch.fnmatchcase(part, pattern[:-2]) for part in rel.split("/")[:-1])


def selected(rel: str, include: Sequence[str] | None, exclude: Sequence[str] | None,
             *, default_excludes: bool = True) -> bool:
    """Whether the file at relative path rel is published.

    An --include pattern selects only matching files (then excludes still apply); excludes are the
    defaults (unless turned off) plus --exclude. An explicit --include of a default-excluded name wins.
    """
    if include and not any(_match(rel, p) for p in include):
        return False
    if exclude and any(_match(rel, p) for p in exclude):
        return False
    if default_excludes and any(_match(rel, p) for p in DEFAULT_EXCLUDES):
        return include is not None and any(_match(rel, p) for p in include if p not in ("*", "**"))
    return True


def is_store_dir(path: str) -> bool:
    """Whether path is the root of a local deltafs store (its deltafs.json says so)."""
    config = os.path.join(path, "deltafs.json")
    if not os.path.isfile(config):
        return False
    try:
        with open(config, "rb") as fh:
            return bool(json.loads(fh.read(1 << 16)).get("format") == "deltafs.store")
    except (OSError, ValueError, AttributeError, RecursionError):
        return False


def refuse_unpublishable(src: str) -> None:
    """A deltafs store, or a pulled DEST (a symlink into DEST.deltafs/), is not a checkpoint to push."""
    if os.path.isdir(src) and is_store_dir(src):
        raise SourceError(f"{src} is a deltafs store, not a checkpoint (are SRC and STORE swapped?)")
    if os.path.islink(src):
        target = os.path.realpath(src)
        parent = os.path.dirname(target)
        if parent.endswith(".deltafs") and os.path.basename(target).startswith("v"):
            raise SourceError(f"{src} is a deltafs pull destination; push the trainer's checkpoint instead "
                              f"(or pass its version directory {target} if you really mean to re-publish it)")
