#!/usr/bin/env bash
# Prepare, on the development machine, what benchmarks/device_check.sh needs on a lent accelerator machine
# (16 cores, Python 3.12, torch with CUDA, no internet): wheels of the packages its image lacks, and the three
# files of slime that sync_bench runs. Both go into folders git ignores, which the device call carries:
#
#   bash benchmarks/device_prepare.sh /path/to/slime-checkout      # once, here
#   run(command="bash benchmarks/device_check.sh", carry=[".whl", ".slime"], timeout_s=590)
#
# See docs/sync_bench.md, "Thread scaling", for what the run measures and where its results go.
set -euo pipefail
cd "$(dirname "$0")/.."
SLIME=${1:-}
PY=${PYTHON:-python3}

for d in /.whl/ /.slime/; do
    grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done

# The device image has numpy, torch, safetensors, xxhash, fsspec, typer and rich; not these two.
rm -rf .whl && mkdir .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl zstandard==0.25.0
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl watchdog==7.1.0
ls -l .whl

rm -rf .slime
if [ -n "$SLIME" ]; then
    for f in slime/utils/disk_delta.py \
             slime/backends/megatron_utils/update_weight/update_weight_from_disk_delta.py \
             docker/patch/latest/sglang-pull_weights.patch; do
        mkdir -p ".slime/$(dirname "$f")"
        cp "$SLIME/$f" ".slime/$f"
    done
    git -C "$SLIME" rev-parse HEAD > .slime/COMMIT
    echo "slime files from $(cat .slime/COMMIT) in .slime/"
else
    echo "no slime checkout given: the device run will skip slime's rows"
fi
