"""A push of accelerator tensors with and without a DeviceBaseline: bytes that cross to the host, host CPU, time.

    python benchmarks/device_diff.py --base BASE.safetensors --new NEW.safetensors --work /dev/shm/ddiff \
        --rounds 3 --json docs/device_diff.json
    python benchmarks/device_diff.py ... --device cuda        # on a machine with an accelerator

Each mode, in a fresh process per round: load both versions' tensors onto --device, push the base (not measured;
with the baseline it arms it), then push the new version and measure:

  lazy      every tensor behind DeviceBytes, each chunk copied whole to the host when a push worker reads it
            (what push_tensors does for accelerator tensors without a baseline)
  baseline  push_tensors(..., device_baseline=b): the chunk is compared with the previous version on the device,
            only the changed elements cross, and the host rebuilds the chunk from the push cache
            (deltafs.publish.device_diff)

Columns: wall seconds; bytes that crossed to the host; process CPU seconds (every thread); "device-op CPU", the
CPU seconds spent in the baseline's device-side calls (compare, nonzero, gather, device checksum, the copy into
the baseline) and in whole-range copies, timed per call; host CPU = process CPU - device-op CPU.

With --device cpu (no accelerator) the device is a stand-in: the tensors are CPU tensors pushed through DeviceBytes,
"device" ops run on host cores (torch with 1 intra-op thread, so the per-call timers see all of it), and a
"device-to-host" copy is a memcpy. The host CPU column is what carries over to an accelerator; the wall time does
not (the device ops would run on the accelerator, the copies over its link). Never a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

from push_tensors_memory import in_fresh_process, pair_args  # benchmarks/, beside this script

MODES = ("lazy", "baseline")


def _one(args: dict[str, Any], out: Any) -> None:
    import torch
    from safetensors.torch import load_file

    from deltafs.publish import DeviceBaseline, PushOptions, push_tensors
    from deltafs.publish import device_diff as dd
    from deltafs.publish.device_diff import baseline_push
    from deltafs.publish.hf import DeviceBytes, HfTensor, check_tensor, plan_checkpoint
    from deltafs.publish.pipeline import RankWork, Solo, run
    from deltafs.publish.source import memory_source

    torch.set_num_threads(1)
    device, work, mode, threads = args["device"], args["work"], args["mode"], args["threads"]
    store, cache = os.path.join(work, "store"), os.path.join(work, "cache")
    baseline = DeviceBaseline() if mode == "baseline" else None
    device_cpu = [0.0]

    def timed(fn: Any) -> Any:
        def wrapper(*a: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*a)
            finally:
                device_cpu[0] += time.thread_time() - t0
        return staticmethod(wrapper)

    for name in ("_device_diff", "_copy_whole", "_capture"):
        setattr(dd.DeviceBaseline, name, timed(getattr(dd.DeviceBaseline, name)))
    real_read = DeviceBytes.read_against

    def read_against(self: Any, start: int, size: int, o: Any, base: Any, versions: Any) -> Any:
        if self._slot is not None:
            return real_read(self, start, size, o, base, versions)  # the baseline times its own device calls
        t0 = time.thread_time()
        try:
            return real_read(self, start, size, o, base, versions)
        finally:
            device_cpu[0] += time.thread_time() - t0

    DeviceBytes.read_against = read_against  # type: ignore[method-assign]

    def push(tensors: dict[str, Any]) -> Any:
        if device != "cpu":
            return push_tensors(store, tensors, cache_dir=cache, threads=threads, device_baseline=baseline)
        with baseline_push(baseline):  # CPU tensors behind DeviceBytes: the stand-in for an accelerator
            items = [HfTensor(n, check_tensor(n, t), tuple(t.shape), DeviceBytes(t, baseline, n))
                     for n, t in tensors.items()]
            files = memory_source(plan_checkpoint(items).files())
            return run(Solo(), store, RankWork(files), PushOptions(cache_dir=cache, threads=threads),
                       t0=time.monotonic())

    def load(path: str) -> dict[str, Any]:
        return {k: v.clone() if device == "cpu" else v.to(device) for k, v in load_file(path).items()}

    push(load(args["base"]))
    new = load(args["new"])
    model = sum(t.numel() * t.element_size() for t in new.values())
    device_cpu[0] = 0.0
    if device != "cpu":
        torch.cuda.synchronize()
    c0, t0 = time.process_time(), time.perf_counter()
    res = push(new)
    if device != "cpu":
        torch.cuda.synchronize()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    out.put({"mode": mode, "threads": threads, "device": device, "seconds": seconds, "kind": res.kind,
             "bytes_written": res.bytes_written, "model_bytes": model,
             "to_host_bytes": baseline.last.bytes_to_host if baseline else model,
             "ranges_diffed": baseline.last.ranges_diffed if baseline else 0,
             "mismatches": baseline.last.mismatches if baseline else 0,
             "process_cpu": cpu, "device_op_cpu": device_cpu[0], "host_cpu": cpu - device_cpu[0]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pair_args(ap, "1")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    rows = []
    for threads in [int(x) for x in a.threads.split(",")]:
        for rnd in range(a.rounds):
            for mode in MODES:  # alternating, so drift on a shared machine hits both
                row = in_fresh_process(_one, a, mode, threads, rnd)
                rows.append(row)
                print(f"{mode:9s} threads {threads} {row['seconds']:.2f} s, to the host {row['to_host_bytes'] / 2**20:.1f} "
                      f"MiB of {row['model_bytes'] / 2**20:.0f}, CPU {row['process_cpu']:.2f} s = host "
                      f"{row['host_cpu']:.2f} + device ops {row['device_op_cpu']:.2f} ({row['kind']}, "
                      f"{row['mismatches']} mismatches)", flush=True)
    print("\nmedians")
    summary = []
    for threads in sorted({r["threads"] for r in rows}):
        for mode in MODES:
            sel = [r for r in rows if r["threads"] == threads and r["mode"] == mode]
            med = {k: statistics.median(r[k] for r in sel) for k in ("seconds", "process_cpu", "host_cpu",
                                                                     "device_op_cpu", "to_host_bytes")}
            summary.append({"mode": mode, "threads": threads, **med})
            print(f"{mode:9s} threads {threads}: {med['seconds']:.2f} s, host CPU {med['host_cpu']:.2f} s, device-op "
                  f"CPU {med['device_op_cpu']:.2f} s, to the host {med['to_host_bytes'] / 2**20:.1f} MiB")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": a.device, "base": a.base, "new": a.new, "rows": rows, "medians": summary}, fh,
                      indent=1)


if __name__ == "__main__":
    main()
