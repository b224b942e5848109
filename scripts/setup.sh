#!/usr/bin/env bash
# Create .venv (if missing) and install deltafs with everything its tests and demo need.
# torch is pinned: 2.13.0 is the CPU build these machines carry; an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q 'torch==2.13.0' -e '.[test,s3,sglang,megatron]'
.venv/bin/python -c "import deltafs, torch, safetensors, zstandard, fsspec; print('deltafs', deltafs.__version__, 'torch', torch.__version__)"
