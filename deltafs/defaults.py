"""The defaults a user can change (command-line flags, API keywords), in one leaf module.

It imports nothing, so the CLI can show them in --help without importing the code that uses them
(numpy, zstandard, fsspec: a second of start-up on every command, docs/cli_startup.md). The library
takes its defaults from here too, so each number is written once.
"""

from __future__ import annotations

# --- push (deltafs.publish, deltafs.codec) ----------------------------------------------------------
# Keyframe policy: a full version every 50 versions, or sooner once the deltas since the last full
# version add up to the size of a full version (a reader then reads at most ~2x full).
DEFAULT_KEYFRAME_EVERY = 50
DEFAULT_KEYFRAME_BUDGET = 1.0
DEFAULT_LEVEL = 3  # zstd level of the delta chunks' payloads
# zstd level of the chunks stored without a base (full versions, new tensors): on byte planes level 1 is both
# faster and smaller than 3 (docs/benchmarks.md, "Full versions at zstd level 1").
DEFAULT_FULL_LEVEL = 1
MIN_LEVEL, MAX_LEVEL = 1, 22  # zstd's own range: a level outside it is a usage error, not one deep in the codec

# --- gc (deltafs.maintenance.gc) ----------------------------------------------------------------------
# A version stays this long after it stopped being HEAD, and an unreferenced chunk this long after it
# was written: long enough for any pull or push in flight to finish.
DEFAULT_GRACE = 3600.0

# --- watch and engines (deltafs.watch, deltafs.engines) -----------------------------------------------
# Seconds an engine may take to load a version before the switch is given up (and waited out, never retried).
DEFAULT_LOAD_TIMEOUT = 900.0
DEFAULT_MAX_WAIT = 300.0  # idle boundary: switch anyway after this many seconds
DEFAULT_RETRY_MAX = 300.0  # longest wait between retries after failures, seconds
DEFAULT_GROUP_TIMEOUT = 600.0  # multi-node engine: a host that has not staged a version by then is a failure
DEFAULT_HOST_STALE_AFTER = 300.0  # `deltafs status`: a host silent this long is reported stale
