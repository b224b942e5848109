#!/usr/bin/env bash
# Create .venv (if missing) and install deltafs with everything its tests and demo need.
# torch is pinned: 2.13.0 is the CPU build these machines carry; an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch first and on its own, with the venv's own pip: that takes the CPU wheel on disk (a newer pip, or
# resolving torch together with the project, can prefer the CUDA build from the index: 2.7 GB more).
.venv/bin/python -m pip install -q 'torch==2.13.0'
.venv/bin/python -m pip install -q -e '.[torch,test,s3,sglang,megatron]'
.venv/bin/python -c "import deltafs, torch, safetensors, zstandard, fsspec; print('deltafs', deltafs.__version__, 'torch', torch.__version__)"
