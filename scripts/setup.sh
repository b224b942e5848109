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
.venv/bin/python -m pip install -q -e '.[torch,test,dev,s3,sglang,vllm,megatron]'
# The pinned SGLang wheel, for the tests that run SGLang's own HTTP and weight-update code (read as
# text, never installed: importing sglang needs CUDA packages). Cached: downloaded once per checkout.
SGLANG_VERSION=0.5.23
if ! ls .cache/sglang-wheel/sglang-${SGLANG_VERSION}-*.whl >/dev/null 2>&1; then
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_34_x86_64 "sglang==${SGLANG_VERSION}" -d .cache/sglang-wheel
fi
# Bytecode once, as installing a wheel does: with PYTHONDONTWRITEBYTECODE set (as on CI machines) an editable
# install would otherwise recompile every module at each `deltafs` start (~0.25 s).
.venv/bin/python -m compileall -q deltafs cli >/dev/null
.venv/bin/python -c "import deltafs, torch, safetensors, zstandard, fsspec; print('deltafs', deltafs.__version__, 'torch', torch.__version__)"
