#!/usr/bin/env bash
# The measurements only a lent 16-core accelerator machine can make, as one command (prepared with
# benchmarks/device_prepare.sh; see docs/sync_bench.md, "Thread scaling"):
#
#   1. sync_bench on the ~1 GB generator checkpoint at 1, 2, 4, 8 and 16 threads: deltafs push and update pull
#      (Python API) beside `cp -r`, XOR+zstd-1 and, when .slime/ was carried, slime's publish and apply;
#   2. gil_check: the codec's per-chunk work (encode, decode) in N threads against N processes, which tells
#      whether the GIL or the machine stops the scaling;
#   3. engine_pause on the accelerator: the torch engine's pause (in place and spare) against a full reload;
#   4. push_tensors_memory: push_tensors from tensors on the accelerator, read a chunk at a time (DeviceBytes)
#      against copied to the host whole first: time and peak host memory;
#   5. device_diff: push_tensors from the accelerator with a DeviceBaseline (only the changed elements cross to the
#      host) against without: time, bytes to the host, host CPU.
#
# Results land in $OUT (the device tool brings them back): sync_bench_16core.json, gil_check.json,
# engine_pause_cuda.json, push_tensors_memory_cuda.json, device_diff_cuda.json and their logs. A dry run on another machine (about 5 minutes on 2 cores):
#   PYTHON=.venv/bin/python THREADS=1,2 GIL_WORKERS=1,2 DEVICE=cpu OUT=/tmp/device-dry bash benchmarks/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/deltafs-device-out}
THREADS=${THREADS:-1,16,8,4,2}   # 1 and 16 first: a run cut short still has them
DEVICE=${DEVICE:-cuda}
ROUNDS=${ROUNDS:-3}
SYNC_LIMIT=${SYNC_LIMIT:-260}    # seconds; the device tool allows 600 per command
PAUSE_LIMIT=${PAUSE_LIMIT:-120}
GIL_LIMIT=${GIL_LIMIT:-50}
PTM_LIMIT=${PTM_LIMIT:-90}
DIFF_LIMIT=${DIFF_LIMIT:-60}
GIL_WORKERS=${GIL_WORKERS:-1,4,16}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
t0=$(date +%s)

# Packages the image lacks travel as wheels (.whl); deltafs itself is installed from this tree, with its
# console command, next to them. Nothing is fetched.
if ! "$PY" -c "import zstandard, watchdog" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "device_check: the wheels in .whl/ did not install (run benchmarks/device_prepare.sh)"; exit 3; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! "$PY" -c "import deltafs.cli.main" 2>/dev/null || ! command -v deltafs >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/dfs . \
        || { echo "device_check: pip could not install deltafs from this tree"; exit 3; }
    export PYTHONPATH=/tmp/dfs${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/dfs/bin:$PATH
fi

{
    echo "== machine"
    nproc; free -g | head -2; df -h /tmp /dev/shm | tail -2
    "$PY" -c "import sys, numpy, torch; print(sys.version.split()[0], 'numpy', numpy.__version__, 'torch', torch.__version__,
'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"
} 2>&1 | tee "$OUT/machine.txt"

# Scratch on a tmpfs when it has room for the stores, outputs and templates (~9 GB), else on the disk.
SCRATCH=/dev/shm/deltafs-sync-bench
if [ "$(df --output=avail -k /dev/shm | tail -1)" -lt $((12 * 1024 * 1024)) ]; then
    SCRATCH=/tmp/deltafs-sync-bench-scratch
fi
SLIME_ARGS=()
[ -d .slime/slime ] && SLIME_ARGS=(--slime-dir .slime)

# One step: NAME, its time limit, how many lines of its log to show (0: all), then the command. Its output goes to
# $OUT/NAME.log; a step that fails or runs out of time does not stop the next.
step() {
    local name=$1 limit=$2 show=$3
    shift 3
    echo "== $name"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name exit $? after $(( $(date +%s) - t0 )) s"
    if [ "$show" -gt 0 ]; then tail -n "$show" "$OUT/$name.log"; else cat "$OUT/$name.log"; fi
}

echo "(sync_bench: threads $THREADS, scratch $SCRATCH)"
step sync_bench "$SYNC_LIMIT" 40 "$PY" benchmarks/sync_bench.py run --work /tmp/deltafs-sync-bench --scratch "$SCRATCH" \
    --datasets generator --threads "$THREADS" --repeat 1 --no-cli "${SLIME_ARGS[@]}" --out "$OUT/sync_bench_16core.json"
rm -rf "$SCRATCH"

# gil_check: the codec's chunk work in threads against processes
G=/tmp/deltafs-sync-bench/gen-llama-1b-L4-lr9e-07-s0
step gil_check "$GIL_LIMIT" 0 "$PY" benchmarks/gil_check.py --base "$G/base/model.safetensors" \
    --new "$G/new/model.safetensors" --workers "$GIL_WORKERS" --json "$OUT/gil_check.json"

echo "(engine_pause: device $DEVICE, $ROUNDS rounds)"
step engine_pause "$PAUSE_LIMIT" 30 "$PY" benchmarks/engine_pause.py --work /tmp/deltafs-engine-pause --device "$DEVICE" \
    --rounds "$ROUNDS" --json "$OUT/engine_pause_cuda.json"

step push_tensors_memory "$PTM_LIMIT" 0 "$PY" benchmarks/push_tensors_memory.py --base "$G/base/model.safetensors" \
    --new "$G/new/model.safetensors" --work /tmp/deltafs-ptm --device "$DEVICE" --threads 16 --repeat 1 \
    --json "$OUT/push_tensors_memory_cuda.json"

step device_diff "$DIFF_LIMIT" 0 "$PY" benchmarks/device_diff.py --base "$G/base/model.safetensors" \
    --new "$G/new/model.safetensors" --work /tmp/deltafs-ddiff --device "$DEVICE" --threads 16 --rounds 1 \
    --json "$OUT/device_diff_cuda.json"
