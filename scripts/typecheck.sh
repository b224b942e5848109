#!/usr/bin/env bash
# mypy --strict over the package as it is installed: cli/ becomes deltafs/cli/ (pyproject's package-dir).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp -r deltafs "$tmp/deltafs"
rm -rf "$tmp/deltafs/cli"
cp -r cli "$tmp/deltafs/cli"
cp pyproject.toml "$tmp/"
find "$tmp" -name __pycache__ -prune -exec rm -rf {} +
cd "$tmp"
"$OLDPWD/$PY" -m mypy --config-file pyproject.toml deltafs
