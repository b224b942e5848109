"""Whether a running engine can hot-switch from one checkpoint directory to another.

A weight update swaps tensors only: SGLang's update_weights_from_disk never reloads config.json or
the tokenizer, reads only the top-level *.safetensors (filtered by the index), and a tensor missing
from the new directory silently keeps its old value. So a version whose config, tokenizer files or
tensor names and shapes differ from the served one needs an engine restart.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from typing import Any

# Read by engines at start-up only. generation_config.json holds default sampling parameters.
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
                   "chat_template.json", "preprocessor_config.json")
# Written by the tools that save a checkpoint, not part of the model.
_IGNORED_CONFIG_KEYS = ("transformers_version", "_name_or_path")


def restart_reason(served: str, new: str) -> str | None:
    """Why new cannot be hot-switched in over served, in words; None when only weights differ."""
    for name in CONFIG_FILES + TOKENIZER_FILES:
        a, b = _file(served, name), _file(new, name)
        if a != b:
            what = "config" if name in CONFIG_FILES else "tokenizer file"
            if a is None or b is None:
                return f"{what} {name} {'added' if a is None else 'removed'}"
            return f"{what} {name} changed"
    try:
        old = tensor_layout(served)  # a checkpoint deltafs may never have checked (the engine's first one)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError, struct.error) as exc:
        return f"the tensor layout of the served checkpoint cannot be read ({exc})"
    now = tensor_layout(new)  # verified by the pull: an error here is one (EMFILE, EIO), not a reason to restart
    if old.keys() != now.keys():
        added, removed = sorted(now.keys() - old.keys()), sorted(old.keys() - now.keys())
        parts = [f"{len(lst)} {word} ({', '.join(lst[:3])}{', ...' if len(lst) > 3 else ''})"
                 for lst, word in ((added, "added"), (removed, "removed")) if lst]
        return "tensor names differ: " + "; ".join(parts)
    changed = sorted(n for n in old if old[n] != now[n])
    if changed:
        return f"tensor shapes or dtypes differ: {', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''}"
    return None


def _file(directory: str, name: str) -> Any:
    """A file's content for comparison: parsed JSON (minus tool stamps) or bytes; None when absent."""
    path = os.path.join(directory, name)
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return None
    if name.endswith(".json"):
        try:
            value = json.loads(data)
        except (ValueError, RecursionError):
            return data
        if isinstance(value, dict):
            for key in _IGNORED_CONFIG_KEYS:
                value.pop(key, None)
        return value
    return data


def tensor_layout(directory: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) of the tensors an engine would load: top-level *.safetensors, by the index."""
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as fh:
            wanted = set(json.load(fh).get("weight_map", {}).values())
        files = [f for f in files if os.path.basename(f) in wanted]
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in files:
        with open(path, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, meta in header.items():
            if name != "__metadata__":
                out[name] = (str(meta["dtype"]), tuple(int(d) for d in meta["shape"]))
    return out
