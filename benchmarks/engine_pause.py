"""Engine pause benchmark: TorchModuleEngine's in-place switch against a full reload, on the same pulled directories.

    python benchmarks/engine_pause.py --work /tmp/engine-pause --device cpu --json docs/engine_pause.json
    python benchmarks/engine_pause.py --work /tmp/engine-pause --device cuda      # the accelerator row
    python benchmarks/engine_pause.py --work /tmp/engine-pause-v --variants       # in-place ops vs a full reload

For each data set two versions are pushed to a local store and pulled (so the engine reads real version directories
with their manifests); the second changes `--fraction` of the elements of every tensor (random positions, the lowest
mantissa bit flipped, i.e. +-1 ulp, as small optimizer steps do). A module holding the data set's tensors lives on
`--device`. Each round then measures, in turn:

  engine v1->v2, engine v2->v1   what TorchModuleEngine.switch does: applier.stage() while the module serves (read,
                                 check, diff, move to the device; reported apart), then applier.commit(), which
                                 switch runs under the lock: the pause (scatter, read back, verify on the device)
  spare v1->v2, spare v2->v1     the same with TorchModuleEngine(spare=True), on a second module: staging also writes
                                 the new bytes into a spare buffer per tensor and verifies it; the pause swaps
  full reload                    safetensors.torch.load_file(every shard, device=...) + module.load_state_dict, the
                                 naive reload of the same pulled directory (all of it is pause)
  load_state_dict only           module.load_state_dict from host tensors already loaded (the copy alone; a floor
                                 for any reload that copies every tensor)

Data sets:
  llama       Llama-shaped bf16 (deltafs.testing.generator.ModelConfig; by default hidden 2048, intermediate 8192,
              2 layers, vocab 32000, untied: 253M parameters, 505 MB), 21 tensors
  small-f32   48 layers x 32 modules x (weight, bias), 1-D F32 of 64-8191 elements: 3,072 tensors, 51 MB

Medians over --rounds, as wall time and as CPU seconds of the process (all threads; on a shared host the CPU
seconds are the steadier measure). On an accelerator every measurement ends with a device synchronize.
Never a test: timings depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from deltafs.engines.base import Target
from deltafs.engines.torch_module import TorchModuleEngine
from deltafs.publish import push_tensors
from deltafs.read.pull import pull
from deltafs.testing.generator import ModelConfig


def llama_tensors(layers: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
    config = ModelConfig("llama-bench", vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_layers=layers,
                         num_heads=32, num_kv_heads=8, head_dim=64)
    out = {}
    for name, shape in config.shapes().items():
        scale = 1.0 if name.endswith("layernorm.weight") or name == "model.norm.weight" else 0.02
        values = rng.standard_normal(int(np.prod(shape)), dtype=np.float32) * scale
        out[name] = torch.from_numpy(values).reshape(shape).to(torch.bfloat16)
    return out


def small_f32_tensors(rng: np.random.Generator) -> dict[str, torch.Tensor]:
    out = {}
    for layer in range(48):
        for module in range(32):
            for leaf in ("weight", "bias"):
                n = int(rng.integers(64, 8192))
                out[f"layers.{layer}.m{module}.{leaf}"] = torch.from_numpy(rng.standard_normal(n, dtype=np.float32))
    return out


def perturb(tensors: dict[str, torch.Tensor], fraction: float, rng: np.random.Generator) -> dict[str, torch.Tensor]:
    """A copy with about `fraction` of each tensor's elements moved by one ulp (lowest mantissa bit flipped)."""
    out = {}
    for name, t in tensors.items():
        t = t.clone()
        bits = t.view(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()]).numpy()
        pos = np.flatnonzero(rng.random(bits.size) < fraction)
        bits[pos] ^= 1
        out[name] = t
    return out


def module_of(tensors: dict[str, torch.Tensor], device: str) -> torch.nn.Module:
    """A module with a parameter under each dotted name (zeros: the first switch loads version 1)."""
    root = torch.nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(torch.zeros(t.shape, dtype=t.dtype, device=device),
                                                      requires_grad=False))
    return root


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elif device.startswith("xpu"):
        torch.xpu.synchronize()


def timed(fn: Callable[[], Any], device: str) -> tuple[Any, tuple[float, float]]:
    """fn's result and (wall seconds, CPU seconds of this process, all threads); ends with a device synchronize."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    sync(device)
    return out, (time.perf_counter() - wall, time.process_time() - cpu)


def full_reload(module: torch.nn.Module, path: str, device: str) -> None:
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        state.update(load_file(os.path.join(path, shard), device=device))
    module.load_state_dict(state)


def run_dataset(name: str, tensors: dict[str, torch.Tensor], args: argparse.Namespace,
                rng: np.random.Generator) -> dict[str, Any]:
    work = os.path.join(args.work, name)
    shutil.rmtree(work, ignore_errors=True)
    store, dest = os.path.join(work, "store"), os.path.join(work, "dest")
    v2 = perturb(tensors, args.fraction, rng)
    changed = sum(int((a.view(-1).view(torch.uint8) != b.view(-1).view(torch.uint8)).sum()) for a, b in
                  zip(tensors.values(), v2.values(), strict=True))  # bytes that differ; one per changed element here
    elements = sum(t.numel() for t in tensors.values())
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    paths = []
    for version in (tensors, v2):
        push_tensors(store, version, cache_dir=os.path.join(work, "cache"))
        paths.append(pull(store, dest, keep=5).path)
    del v2
    host_state = {k: v.clone() for k, v in tensors.items()}  # version 1, already loaded (load_state_dict only)
    del tensors
    module = module_of(host_state, args.device)
    engines = {"engine": TorchModuleEngine(module)}
    if not args.no_spare:
        engines["spare"] = TorchModuleEngine(module_of(host_state, args.device), spare=True)
    for engine in engines.values():
        engine.switch(Target(paths[0], "1"), None)  # the first apply loads everything; not measured
    pauses: dict[str, list[tuple[float, float]]] = {key: [] for key in engines}
    stages: dict[str, list[float]] = {key: [] for key in engines}
    reloads, copies = [], []
    for _ in range(args.rounds):
        for key, engine in engines.items():
            for b in (1, 0):
                # what switch() does: stage while serving, then commit under the lock (the pause)
                staged = engine.applier.stage(paths[b])
                report, pause = timed(lambda staged=staged, engine=engine: engine.applier.commit(staged), args.device)
                assert report.whole == 0, report  # every changed tensor scattered, none copied whole
                assert report.swapped == (report.changed if key == "spare" else 0), report
                pauses[key].append(pause)
                stages[key].append(report.stage_seconds)
        # the engine is back on version 1: reloading version 1's directory keeps what it believes true
        reloads.append(timed(lambda: full_reload(module, paths[0], args.device), args.device)[1])
        copies.append(timed(lambda: module.load_state_dict(host_state), args.device)[1])
    assert all(engine.applier.verify() == [] for engine in engines.values())
    row: dict[str, Any] = {
        "data": name, "device": args.device, "tensors": len(host_state), "MB": round(nbytes / 1e6, 1),
        "changed_pct": round(100 * changed / elements, 2),
    }
    samples_of = {"full_reload": reloads, "load_state_dict_only": copies}
    for key in engines:
        samples_of[f"{key}_pause"] = pauses[key]
        row[f"{key}_stage_s"] = statistics.median(stages[key])
    for key, samples in samples_of.items():
        row[f"{key}_s"] = statistics.median(s[0] for s in samples)
        row[f"{key}_cpu_s"] = statistics.median(s[1] for s in samples)
    for key in engines:
        prefix = "pause" if key == "engine" else "spare_pause"
        for unit in ("s", "cpu_s"):
            row[f"{prefix}_vs_full_reload_{unit}"] = row[f"{key}_pause_{unit}"] / row[f"full_reload_{unit}"]
            row[f"{prefix}_vs_load_state_dict_only_{unit}"] = (row[f"{key}_pause_{unit}"]
                                                                / row[f"load_state_dict_only_{unit}"])
    shutil.rmtree(work, ignore_errors=True)
    return row


def scatter_variants(args: argparse.Namespace, rng: np.random.Generator) -> None:
    """--variants: in-place update variants on the llama data set (CPU), each against a full reload, in one run.

    No deltafs staging: the changed positions (int64, sorted) and values are made directly, so the numbers isolate
    the op. "scatter+read back" is what the in-place pause does per block; "scatter only" drops its verification.
    """
    tensors = llama_tensors(args.layers, rng)
    os.makedirs(args.work, exist_ok=True)
    path = os.path.join(args.work, "llama.safetensors")
    save_file(tensors, path)
    module = module_of(tensors, "cpu")
    module.load_state_dict(tensors)
    live = dict(module.named_parameters())
    flats = [live[n].detach().view(-1).view(torch.int16) for n in tensors]
    idx = [torch.from_numpy(np.flatnonzero(rng.random(f.numel()) < args.fraction)) for f in flats]
    vals = [f[i] ^ 1 for f, i in zip(flats, idx, strict=True)]

    def blocks(span: int, positions: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        out = []
        for f, i, v in zip(flats, idx, vals, strict=True):
            cuts = [0, i.numel(), *np.searchsorted(i.numpy(), np.arange(span, f.numel(), span)).tolist()]
            cuts = sorted(set(cuts))
            out += [(f, i[a:b].to(positions), v[a:b], torch.empty_like(v[a:b]))
                    for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
        return out

    pool = ThreadPoolExecutor(torch.get_num_threads())

    def spread(op: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], Any], span: int,
               positions: torch.dtype = torch.int64) -> Callable[[], None]:
        todo = blocks(span, positions)
        step = -(-len(todo) // torch.get_num_threads())

        def run(part: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
            for block in part:
                op(*block)
        return lambda: list(pool.map(run, [todo[k:k + step] for k in range(0, len(todo), step)])) and None

    def scatter_back(f: torch.Tensor, i: torch.Tensor, v: torch.Tensor, b: torch.Tensor) -> None:
        f.scatter_(0, i, v)
        torch.index_select(f, 0, i, out=b)

    span, whole = 1 << 18, 1 << 62
    variants: dict[str, Callable[[], Any]] = {
        "full reload (load_file + load_state_dict)": lambda: module.load_state_dict(load_file(path)),
        "load_state_dict only": lambda: module.load_state_dict(tensors),
        "scatter_+read back, 256Ki spans (the engine)": spread(scatter_back, span),
        "scatter_+read back, 64Ki spans": spread(scatter_back, 1 << 16),
        "scatter_+read back, 1Mi spans": spread(scatter_back, 1 << 20),
        "scatter_+read back, per tensor": spread(scatter_back, whole),
        "scatter_ only, 256Ki spans": spread(lambda f, i, v, b: f.scatter_(0, i, v), span),
        "scatter_ only, per tensor": spread(lambda f, i, v, b: f.scatter_(0, i, v), whole),
        "index_copy_ only, 256Ki spans": spread(lambda f, i, v, b: f.index_copy_(0, i, v), span),
        "index_put_ only, 256Ki spans": spread(lambda f, i, v, b: f.index_put_((i,), v), span),
        "index_put_ only, int32 positions": spread(lambda f, i, v, b: f.index_put_((i,), v), span, torch.int32),
        "read back only (index_select)": spread(lambda f, i, v, b: torch.index_select(f, 0, i, out=b), span),
    }
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    for _ in range(args.rounds):  # interleaved, so a noisy moment hits every variant alike
        for key, fn in variants.items():
            with torch.no_grad():
                samples[key].append(timed(fn, "cpu")[1])
    base = [statistics.median(s[u] for s in samples["full reload (load_file + load_state_dict)"]) for u in (0, 1)]
    print(f"\n{sum(int(i.numel()) for i in idx)} of {sum(f.numel() for f in flats)} elements changed; "
          f"{torch.get_num_threads()} threads; medians of {args.rounds} rounds, wall (CPU seconds)")
    print("| variant | time | / full reload |\n|---|---|---|")
    for key, got in samples.items():
        wall, cpu = (statistics.median(s[u] for s in got) for u in (0, 1))
        print(f"| {key} | {wall * 1e3:.0f} ms ({cpu * 1e3:.0f}) | {wall / base[0]:.2f}x ({cpu / base[1]:.2f}x) |")
    shutil.rmtree(args.work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, help="scratch directory (stores and pulled versions; removed after)")
    ap.add_argument("--device", default="cpu", help="where the module lives: cpu, cuda, cuda:1, xpu")
    ap.add_argument("--data", nargs="+", default=["llama", "small-f32"], choices=["llama", "small-f32"])
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the llama data set")
    ap.add_argument("--fraction", type=float, default=0.02, help="fraction of elements changed per version")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", action="store_true", help="time in-place update ops on the llama data instead")
    ap.add_argument("--no-spare", action="store_true", help="measure only the default in-place engine")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    if args.variants:
        scatter_variants(args, rng)
        return
    rows = []
    for name in args.data:
        tensors = llama_tensors(args.layers, rng) if name == "llama" else small_f32_tensors(rng)
        rows.append(run_dataset(name, tensors, args, rng))
        print(json.dumps(rows[-1]), flush=True)
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
           "machine": platform.machine(), "python": platform.python_version(),
           "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
           "peak_rss_MB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
           "fraction": args.fraction, "rounds": args.rounds}
    print("\n| data | device | tensors | MB | changed | full reload | load_state_dict only | engine pause | pause / "
          "full reload | pause / load_state_dict only | staging | spare pause | spare / full reload | spare staging |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")

    def ms(r: dict[str, Any], key: str) -> str:
        return f"{r[key + '_s'] * 1e3:.3g} ms ({r[key + '_cpu_s'] * 1e3:.3g})"

    def ratio(r: dict[str, Any], key: str) -> str:
        return f"{r[key + '_s']:.3f}x ({r[key + '_cpu_s']:.3f}x)"

    for r in rows:  # wall (CPU seconds of the process in brackets)
        print(f"| {r['data']} | {r['device']} | {r['tensors']} | {r['MB']} | {r['changed_pct']}% | "
              f"{ms(r, 'full_reload')} | {ms(r, 'load_state_dict_only')} | {ms(r, 'engine_pause')} | "
              f"{ratio(r, 'pause_vs_full_reload')} | {ratio(r, 'pause_vs_load_state_dict_only')} | "
              f"{r['engine_stage_s']:.2f} s | "
              + (f"{ms(r, 'spare_pause')} | {ratio(r, 'spare_pause_vs_full_reload')} | {r['spare_stage_s']:.2f} s |"
                 if "spare_pause_s" in r else "- | - | - |"))
    print(json.dumps(env))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"env": env, "rows": rows}, fh, indent=1, sort_keys=True)
            fh.write("\n")


if __name__ == "__main__":
    main()
