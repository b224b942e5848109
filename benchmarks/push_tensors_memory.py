"""push_tensors from tensors that are not in host memory: host memory and time of a delta push, three ways.

    python benchmarks/push_tensors_memory.py --base BASE.safetensors --new NEW.safetensors --work /dev/shm/ptm \
        --threads 1,2 --json docs/push_tensors_memory.json
    python benchmarks/push_tensors_memory.py ... --device cuda        # on a machine with an accelerator

Each mode runs in a fresh process: load both versions' tensors (onto --device), push the base (not measured), then
push the new version, measuring wall time and the process's peak resident memory above what it held before that
push (VmHWM reset through /proc/self/clear_refs; tensors on the host count in "before", so only what the push itself
holds is reported).

  host           tensors in host memory: the push reads them in place (no copy)
  device-lazy    every tensor behind DeviceBytes, what a contiguous accelerator tensor gets: each chunk is copied to
                 the host when a push worker reads it (deltafs >= this change)
  device-upfront every tensor copied to the host whole before the push starts (deltafs.publish.hf.host_bytes), what
                 an accelerator tensor got before

With --device cpu (no accelerator) the two device modes are stand-ins: their host copies are real copies of the same
sizes at the same moments, but a device-to-host transfer costs more than a host memcpy, so only the memory column
carries over to a GPU; --device cuda measures the real thing. Never a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import shutil
import time
from typing import Any

MODES = ("host", "device-lazy", "device-upfront")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _load(path: str, device: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    # load_file maps the file: clone so host tensors are anonymous memory, counted in "before" like a trainer's
    return {k: v.clone() if device == "cpu" else v.to(device) for k, v in load_file(path).items()}


def _push(store: str, tensors: dict[str, Any], mode: str, cache: str, threads: int) -> Any:
    from deltafs.publish import PushOptions, push_tensors
    from deltafs.publish.hf import DeviceBytes, HfTensor, check_tensor, host_bytes, plan_checkpoint
    from deltafs.publish.pipeline import RankWork, Solo, run
    from deltafs.publish.source import memory_source

    on_host = all(t.device.type == "cpu" for t in tensors.values())
    if (mode == "host" and on_host) or (mode == "device-lazy" and not on_host):
        return push_tensors(store, tensors, cache_dir=cache, threads=threads)  # the library's own choice

    def upfront(t: Any) -> Any:
        return host_bytes(t).copy() if t.device.type == "cpu" else host_bytes(t)  # a host copy either way

    wrap = DeviceBytes if mode == "device-lazy" else upfront
    items = [HfTensor(n, check_tensor(n, t), tuple(t.shape), wrap(t)) for n, t in tensors.items()]
    files = memory_source(plan_checkpoint(items).files())
    return run(Solo(), store, RankWork(files), PushOptions(cache_dir=cache, threads=threads), t0=time.monotonic())


def _one(args: dict[str, Any], out: Any) -> None:
    device, work, mode, threads = args["device"], args["work"], args["mode"], args["threads"]
    store, cache = os.path.join(work, "store"), os.path.join(work, "cache")
    base = _load(args["base"], device)
    _push(store, base, "host" if device == "cpu" else mode, cache, threads)  # the base version, not measured
    del base
    new = _load(args["new"], device)
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    res = _push(store, new, mode, cache, threads)
    if device != "cpu":
        import torch

        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    out.put({"mode": mode, "threads": threads, "device": device, "seconds": seconds, "kind": res.kind,
             "rss_before_mib": before / 1024, "peak_above_mib": (_status_kib("VmHWM") - before) / 1024,
             "model_mib": sum(t.numel() * t.element_size() for t in new.values()) / 2**20})


def pair_args(ap: argparse.ArgumentParser, threads: str) -> None:
    """The arguments of a benchmark over a base/new checkpoint pair pushed from tensors (also device_diff.py)."""
    ap.add_argument("--base", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--work", required=True, help="scratch: stores and caches (a tmpfs measures without the disk)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", default=threads)
    ap.add_argument("--json")


def in_fresh_process(target: Any, a: argparse.Namespace, mode: str, threads: int, tag: int) -> dict[str, Any]:
    """target(args, queue) in a spawned process over its own work directory (removed after); the row it puts."""
    work = os.path.join(a.work, f"{mode}-{threads}-{tag}")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=target, args=({"device": a.device, "work": work, "mode": mode,
                                                              "threads": threads, "base": a.base, "new": a.new}, q))
    p.start()
    while True:  # a worker that dies (an exception, the OOM killer) must not leave the driver waiting forever
        try:
            row: dict[str, Any] = q.get(timeout=5)
            break
        except queue.Empty:
            if not p.is_alive():
                raise RuntimeError(f"the {mode} worker died (exit code {p.exitcode})") from None
    p.join()
    shutil.rmtree(work, ignore_errors=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pair_args(ap, "1,2")
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    rows = []
    for threads in [int(x) for x in a.threads.split(",")]:
        for rep in range(a.repeat):
            for mode in MODES if a.device == "cpu" else MODES[1:]:  # "host" is for host tensors
                row = in_fresh_process(_one, a, mode, threads, rep)
                rows.append(row)
                print(f"{mode:15s} threads {threads} {row['seconds']:.3f} s  peak above start "
                      f"{row['peak_above_mib']:.0f} MiB (model {row['model_mib']:.0f} MiB, {row['kind']})", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": a.device, "base": a.base, "new": a.new, "rows": rows}, fh, indent=1)

if __name__ == "__main__":
    main()
