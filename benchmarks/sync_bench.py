"""End-to-end weight-sync benchmark: deltafs push / update pull against `cp -r`, slime's own publish/apply code
and a plain numpy XOR+zstd-1 tool, side by side on the same files in one run, reported as ratios.

    git clone https://github.com/THUDM/slime /opt/slime
    git -C /opt/slime checkout 624b824a898ab0ec1fcb4d373004c7f3852bf515     # the commit docs/sync_bench.md used
    python benchmarks/sync_bench.py run --slime-dir /opt/slime --work /tmp/sync-bench --threads 1,2 \
        --out docs/sync_bench.json

slime's code is never copied into this repository: it is loaded at run time from --slime-dir, which needs only
    slime/utils/disk_delta.py
    slime/backends/megatron_utils/update_weight/update_weight_from_disk_delta.py     (the publisher, trainer side)
    docker/patch/latest/sglang-pull_weights.patch      (the applier: local_checkpoint.py, added by this patch)
The publisher class is run on one trainer rank: a gloo process group of one process, and stand-in modules for what
its file imports but the publish path never calls (ray, megatron's mpu, slime's accelerator and the base class's
NCCL machinery). Its tensors come from the new checkpoint on disk (safetensors, read inside the timed section);
its previous version is the in-RAM snapshot slime keeps between steps (captured by slime's own `_capture_baseline`,
untimed). The applier is the file the patch adds, extracted at run time into a temporary module and called as the
engine calls it: `pull(local_checkpoint_dir, base_dir, source_dir, target_version)`.

Every measured step runs in its own process, so peak RSS (ru_maxrss), CPU seconds and bytes written
(/proc write_bytes, which counts pages dirtied) are its own. Python workers also time their call alone (`seconds`),
excluding interpreter start and imports; CLI rows are the whole command's wall time.
"""

from __future__ import annotations

import argparse
import filecmp
import glob
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

GB = 1e9
SLIME_COMMIT_DOCUMENTED = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
SLIME_PUBLISHER = "slime/backends/megatron_utils/update_weight/update_weight_from_disk_delta.py"
SLIME_DISK_DELTA = "slime/utils/disk_delta.py"
SLIME_PATCH = "docker/patch/latest/sglang-pull_weights.patch"
SLIME_APPLIER_IN_PATCH = "python/sglang/srt/weight_sync/local_checkpoint.py"


# --- helpers shared by workers and the driver -------------------------------------------------------------
def io_so_far() -> dict[str, int]:
    """This process's (and its reaped children's) writes from /proc/self/io: `wchar`, the bytes handed to
    write(2)-like calls on any filesystem (stores through mmap are not counted), and `write_bytes`, the bytes
    sent to a block device (pages dirtied; 0 on a tmpfs)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {"wchar": int(fields["wchar"]),
            "write_bytes": int(fields["write_bytes"]) - int(fields["cancelled_write_bytes"])}


def io_since(start: dict[str, int]) -> dict[str, int]:
    now = io_so_far()
    return {k: now[k] - start[k] for k in now}


def du(path: Path) -> int:
    """Logical size of the files under path (a file counts once however many links it has)."""
    seen, total = set(), 0
    for p in Path(path).rglob("*"):
        if p.is_file() and not p.is_symlink():
            st = p.stat()
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def safetensors_index(path: str) -> dict[str, tuple[int, int]]:
    """Tensor name -> (absolute byte offset, nbytes) from a safetensors header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: (8 + n + v["data_offsets"][0], v["data_offsets"][1] - v["data_offsets"][0])
            for k, v in header.items() if k != "__metadata__"}


def same_tree(expected: Path, got: Path) -> bool | str:
    """True if every file of `expected` is byte-identical in `got` (got may hold extra bookkeeping files).

    When every tensor's bytes match but other bytes do not (slime's deltas carry tensors only: neither a
    safetensors header's metadata nor config.json follow), a string naming what differs; otherwise False.
    """
    differ = []
    for p in sorted(expected.rglob("*")):
        if p.is_file():
            q = got / p.relative_to(expected)
            if not q.is_file():
                return False
            if filecmp.cmp(p, q, shallow=False):
                continue
            if p.suffix == ".safetensors":
                if not _same_tensor_bytes(p, q):
                    return False
                differ.append(f"{p.name} header")
            else:
                differ.append(p.name)
    if not differ:
        return True
    if not any(p.suffix == ".safetensors" for p in expected.rglob("*")):
        return False
    return "tensor bytes identical; stale: " + ", ".join(differ)


def _same_tensor_bytes(a: Path, b: Path) -> bool:
    import numpy as np

    ia, ib = safetensors_index(str(a)), safetensors_index(str(b))
    if ia.keys() != ib.keys() or any(ia[k][1] != ib[k][1] for k in ia):
        return False
    # Read in blocks, never mapped: a mapping would raise this driver's RSS to the file's size, and a child forked
    # afterwards reports it as its own ru_maxrss.
    block = 8 << 20
    with open(a, "rb") as fa, open(b, "rb") as fb:
        for k, (o, n) in ia.items():
            for d in range(0, n, block):
                m = min(block, n - d)
                if not np.array_equal(np.frombuffer(os.pread(fa.fileno(), m, o + d), np.uint8),
                                      np.frombuffer(os.pread(fb.fileno(), m, ib[k][0] + d), np.uint8)):
                    return False
    return True


def import_deltafs_api() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """push and pull from wherever this version of deltafs exports them."""
    try:
        from deltafs import pull, push  # type: ignore[attr-defined]
    except ImportError:
        from deltafs.publish import push
        from deltafs.pull import pull
    return push, pull


def deltafs_cli() -> str:
    exe = shutil.which("deltafs", path=os.path.dirname(sys.executable)) or shutil.which("deltafs")
    if exe is None:
        raise SystemExit("the deltafs console command is not installed (pip install -e .)")
    return exe


# --- data sets ----------------------------------------------------------------------------------------------
def make_generator_dataset(out: Path, config: str, layers: int, lr: float, shard_mb: int) -> dict[str, Any]:
    """Two consecutive bf16 exports of deltafs.testing.generator's AdamW simulator: out/base and out/new."""

    from deltafs.testing.generator import CONFIGS, TrainerSim, changed_fraction, write_checkpoint

    model = CONFIGS[config]
    if layers:
        model = model.with_layers(layers)
    sim = TrainerSim(model, seed=0, lr=lr)
    base = sim.export()
    shard = shard_mb << 20 if shard_mb else None
    write_checkpoint(out / "base", base, model, shard_bytes=shard)  # no step metadata: headers stay equal
    new = sim.step()
    write_checkpoint(out / "new", new, model, shard_bytes=shard)
    frac = changed_fraction(base, new)
    return {"kind": "generator", "config": model.name, "params": model.num_params(), "lr": lr,
            "changed_fraction": frac}


def make_trained_dataset(out: Path, trained_py: str | None, params: str, lr: float, seed: int,
                         warmup: int) -> dict[str, Any]:
    """Two consecutive versions of deltafs.testing.trained (a small GPT really trained with AdamW: bf16 matrices,
    many small 1-D F32 tensors), written by its own write_version: out/base and out/new.

    `trained_py` loads that module from a file (e.g. another branch's checkout) when this deltafs lacks it.
    """
    if trained_py:
        trained = _load_file("deltafs_testing_trained", Path(trained_py))
    else:
        from deltafs.testing import trained  # type: ignore[attr-defined,no-redef]
    cfg = trained.config_for(trained.parse_count(params))
    run = trained.TrainedRun(cfg, seed=seed, lr=lr, warmup_steps=warmup)
    base, new = run.versions(2)
    trained.write_version(out / "base", base, cfg, step=warmup)
    trained.write_version(out / "new", new, cfg, step=warmup + 1)
    return {"kind": "deltafs.testing.trained" + (f" from {trained_py}" if trained_py else ""), "params": cfg.num_params(),
            "layers": cfg.n_layers, "tensors": len(new), "f32_1d_tensors": sum(t.dim() == 1 for t in new.values()),
            "lr": lr, "seed": seed, "warmup_steps": warmup, "changed": trained.changed_fractions(base, new),
            "changed_fraction": trained.changed_fractions(base, new)["all"]}


# --- slime, loaded from --slime-dir ---------------------------------------------------------------------------
def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    mod.__path__ = []  # type: ignore[attr-defined]  # lets submodules be imported from sys.modules
    sys.modules[name] = mod
    return mod


def _load_file(name: str, path: Path) -> types.ModuleType:
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_slime_publisher(slime_dir: Path) -> types.ModuleType:
    """slime's update_weight_from_disk_delta module, importable on a machine without Megatron or Ray.

    The stand-ins cover only names the file imports and the publish path (`_capture_baseline`, `_publish`) does
    not use on a single CPU rank; everything it runs (diff, zstd, checksum, safetensors write) is slime's code.
    """
    import torch.distributed as dist

    class UpdateWeightFromDistributed:  # the attributes slime's base __init__ sets; its NCCL parts are not used
        def __init__(self, args: Any, model: Any, weights_getter: Any, *, model_name: str,
                     quantization_config: Any) -> None:
            self.args, self.model, self.model_name = args, model, model_name
            self.quantization_config = quantization_config
            self.weight_version = 0
            self.update_weight_metrics: dict[str, float] = {}

    no_stream = types.SimpleNamespace(synchronize=lambda: None)  # pinned buffers need an accelerator
    _module("ray", get=lambda refs: list(refs))
    _module("ray.actor", ActorHandle=object)
    _module("megatron")
    _module("megatron.core", mpu=types.SimpleNamespace())
    accelerator = _module("slime.utils.accelerator", current_stream=lambda: no_stream, current_device=lambda: "cpu")
    _module("slime", utils=_module("slime.utils", accelerator=accelerator))
    _load_file("slime.utils.disk_delta", slime_dir / SLIME_DISK_DELTA)
    _module("slime.utils.distributed_utils", get_gloo_group=lambda: dist.group.WORLD)
    for pkg in ("slime.backends", "slime.backends.megatron_utils", "slime.backends.megatron_utils.update_weight"):
        _module(pkg)
    _module("slime.backends.megatron_utils.update_weight.update_weight_from_distributed",
            UpdateWeightFromDistributed=UpdateWeightFromDistributed)
    return _load_file("slime.backends.megatron_utils.update_weight.update_weight_from_disk_delta",
                      slime_dir / SLIME_PUBLISHER)


def extract_added_file(patch_text: str, path: str) -> str:
    """The content of a file a unified diff creates: its '+' lines."""
    out: list[str] = []
    inside = False
    for line in patch_text.splitlines():
        if line.startswith("diff --git "):
            inside = line.endswith(f" b/{path}")
            continue
        if inside and line.startswith("+") and not line.startswith("+++"):
            out.append(line[1:])
    if not out:
        raise SystemExit(f"{path} is not added by the patch")
    return "\n".join(out) + "\n"


def load_slime_applier(slime_dir: Path, patch: str, tmp: Path) -> types.ModuleType:
    source = extract_added_file((slime_dir / patch).read_text(), SLIME_APPLIER_IN_PATCH)
    path = tmp / "slime_local_checkpoint.py"
    path.write_text(source)
    return _load_file("slime_local_checkpoint", path)


def iter_checkpoint_tensors(ckpt: Path) -> Iterator[tuple[str, Any]]:
    from safetensors import safe_open

    for f in sorted(glob.glob(str(ckpt / "*.safetensors"))):
        with safe_open(f, framework="pt") as fh:
            for k in fh.keys():
                yield k, fh.get_tensor(k)


# --- workers: one process per measured step ----------------------------------------------------------------
_CPU: dict[str, Any] = {}


def _timed(fn: Callable[[], Any]) -> tuple[float, int, Any]:
    """Wall seconds and bytes written by fn(); its CPU seconds (all threads) go to _CPU for the result line."""
    w0, c0, t0 = io_so_far(), time.process_time(), time.perf_counter()
    res = fn()
    seconds = time.perf_counter() - t0
    _CPU["cpu_s"] = time.process_time() - c0
    _CPU["io"] = io_since(w0)  # type: ignore[assignment]
    return seconds, _CPU["io"]["wchar"], res  # type: ignore[index]


def worker_slime_publish(a: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    mod = load_slime_publisher(Path(a["slime_dir"]))
    mod.NUM_WORKERS = a["threads"]  # the pool size slime sizes from os.cpu_count()
    torch.set_num_threads(a["threads"])
    dist.init_process_group("gloo", init_method=f"file://{a['tmp']}/pg", rank=0, world_size=1)
    args = argparse.Namespace(update_weight_disk_dir=a["out"], update_weight_delta_encoding="xor",
                              update_weight_delta_checksum="xxh3-128", custom_update_weight_post_write_path=None,
                              hf_checkpoint=a["base"])
    pub = mod.UpdateWeightFromDiskDelta(args, [], dict, model_name="bench", quantization_config=None)
    pub.rollout_engines, pub._is_pp_src_rank = [], True
    current = {"dir": Path(a["base"])}
    pub._iter_hf_tensors = lambda: iter_checkpoint_tensors(current["dir"])  # stands in for the Megatron gather
    pub._capture_baseline()  # slime's own: snapshot of the previous version in RAM
    current["dir"] = Path(a["new"])
    pub.weight_version = 1
    seconds, written, _ = _timed(pub._publish)
    dist.destroy_process_group()
    return {"seconds": seconds, "wchar": written, "delta_bytes": du(Path(a["out"]) / "weight_v000001"),
            "changed_fraction_bytes": pub.changed_bytes / max(pub.total_bytes, 1)}


def worker_slime_apply(a: dict[str, Any]) -> dict[str, Any]:
    mod = load_slime_applier(Path(a["slime_dir"]), a["patch"], Path(a["tmp"]))
    mod.NUM_WORKERS = a["threads"]
    mod.pull(a["local"], a["base"], a["source"], 0)  # the engine's base, copied to the host-local dir (untimed)
    seconds, written, _ = _timed(lambda: mod.pull(a["local"], a["base"], a["source"], 1))
    return {"seconds": seconds, "wchar": written}


def worker_xz_write(a: dict[str, Any]) -> dict[str, Any]:
    import numpy, zstandard  # noqa: F401,E401  # imported before the clock starts, as slime's are
    seconds, written, delta = _timed(lambda: xz_write(Path(a["base"]), Path(a["new"]), Path(a["out"]), a["threads"]))
    return {"seconds": seconds, "wchar": written, "delta_bytes": delta}


def worker_xz_apply(a: dict[str, Any]) -> dict[str, Any]:
    import numpy, zstandard  # noqa: F401,E401
    seconds, written, _ = _timed(lambda: xz_apply(Path(a["base"]), Path(a["delta"]), Path(a["out"]), a["threads"]))
    return {"seconds": seconds, "wchar": written}


def worker_api_push(a: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    push, _ = import_deltafs_api()
    import_s = time.perf_counter() - t0
    seconds, written, res = _timed(lambda: push(a["store"], a["new"], cache_dir=a["cache"], threads=a["threads"]))
    return {"seconds": seconds, "import_s": import_s, "wchar": written, "result": res.to_json()}


def worker_api_pull(a: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    _, pull = import_deltafs_api()
    import_s = time.perf_counter() - t0
    seconds, written, res = _timed(lambda: pull(a["store"], a["dest"], threads=a["threads"], recycle=a["recycle"]))
    return {"seconds": seconds, "import_s": import_s, "wchar": written, "result": res.to_json()}


WORKERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "slime_publish": worker_slime_publish, "slime_apply": worker_slime_apply, "xz_write": worker_xz_write,
    "xz_apply": worker_xz_apply, "api_push": worker_api_push, "api_pull": worker_api_pull,
}


# --- the XOR+zstd-1 anchor: the simplest tool of slime's kind ----------------------------------------------
BLOCK = 4 << 20  # bytes per XOR step inside a tensor (cache-sized, as slime's apply uses 2 MB blocks)

def xz_write(base: Path, new: Path, out: Path, threads: int) -> int:
    """One zstd level-1 frame of (new XOR old) per changed tensor, in one file plus a JSON index; fsynced once
    (as slime's _atomic_write).

    Both versions are read from disk (np.memmap); numpy and zstd release the GIL, so a thread pool over tensors
    uses the cores.
    """
    import numpy as np
    import zstandard

    out.mkdir(parents=True)
    index: dict[str, Any] = {"tensors": {}, "files": []}
    with open(out / "delta.bin", "wb") as sink, ThreadPoolExecutor(threads) as pool:
        for f in sorted(p for p in new.iterdir() if p.is_file()):
            old_f = base / f.name
            if f.suffix != ".safetensors":
                if not (old_f.is_file() and filecmp.cmp(f, old_f, shallow=False)):
                    shutil.copyfile(f, out / f.name)
                    index["files"].append(f.name)
                continue
            cur, old = np.memmap(f, np.uint8, "r"), np.memmap(old_f, np.uint8, "r")
            where = safetensors_index(str(f))
            if where != safetensors_index(str(old_f)):
                raise SystemExit(f"{f.name}: tensor layouts differ; the anchor handles same-layout versions only")
            head = min(off for off, _ in where.values())
            if cur[:head].tobytes() != old[:head].tobytes():  # same layout, other metadata (e.g. a step number)
                index.setdefault("headers", {})[f.name] = [sink.tell(), head]
                sink.write(cur[:head].tobytes())

            def encode(item: tuple[str, tuple[int, int]]) -> tuple[str, bytes | None]:
                # Blocks of BLOCK bytes keep XOR and zstd in cache; the tensor is still one zstd frame.
                name, (off, n) = item
                comp = zstandard.ZstdCompressor(level=1).compressobj(size=n)
                parts, changed = [], False
                for b in range(off, off + n, BLOCK):
                    diff = np.bitwise_xor(cur[b:min(b + BLOCK, off + n)], old[b:min(b + BLOCK, off + n)])
                    changed = changed or bool(diff.any())
                    parts.append(comp.compress(diff))
                parts.append(comp.flush())
                return name, b"".join(parts) if changed else None

            for name, frame in pool.map(encode, where.items()):
                if frame is not None:
                    index["tensors"].setdefault(f.name, {})[name] = [sink.tell(), len(frame)]
                    sink.write(frame)
        sink.flush()
        os.fsync(sink.fileno())
    (out / "delta.json").write_text(json.dumps(index))
    return du(out)


def xz_apply(base: Path, delta: Path, out: Path, threads: int) -> None:
    """A complete new checkpoint in `out`, one pass: each tensor is read from the base in blocks, XORed with its
    streamed zstd frame if it changed, and written at its offset (pread/pwrite, a thread pool over tensors);
    files without a changed tensor are copied."""
    import numpy as np
    import zstandard

    index = json.loads((delta / "delta.json").read_text())
    out.mkdir(parents=True)
    for f in base.iterdir():
        if f.is_file() and f.name not in index["tensors"] and f.name not in index.get("headers", {}):
            shutil.copyfile(f, out / f.name)
    for name in index["files"]:
        shutil.copyfile(delta / name, out / name)
    blob = (delta / "delta.bin").read_bytes()
    with ThreadPoolExecutor(threads) as pool:
        for fname in sorted(set(index["tensors"]) | set(index.get("headers", {}))):
            changed = index["tensors"].get(fname, {})
            where = safetensors_index(str(base / fname))
            src = os.open(base / fname, os.O_RDONLY)
            dst = os.open(out / fname, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.ftruncate(dst, os.fstat(src).st_size)
                head = min(off for off, _ in where.values())
                if fname in index.get("headers", {}):
                    start, length = index["headers"][fname]
                    os.pwrite(dst, blob[start:start + length], 0)
                else:
                    os.pwrite(dst, os.pread(src, head, 0), 0)

                def one(item: tuple[str, tuple[int, int]]) -> None:
                    name, (off, n) = item
                    reader = None
                    if name in changed:
                        start, length = changed[name]
                        reader = zstandard.ZstdDecompressor().stream_reader(blob[start:start + length])
                    for b in range(off, off + n, BLOCK):
                        size = min(BLOCK, off + n - b)
                        data = os.pread(src, size, b)
                        if reader is not None:
                            diff = reader.read(size)
                            data = np.bitwise_xor(np.frombuffer(data, np.uint8), np.frombuffer(diff, np.uint8))
                        os.pwrite(dst, data, b)

                list(pool.map(one, where.items()))
            finally:
                os.close(src)
                os.close(dst)


# --- driver -------------------------------------------------------------------------------------------------
WARM = {"bytes": 0}  # set by cmd_run from --warm-gib / the data set's size


def warm_pages(nbytes: int) -> None:
    """Touch and free nbytes of anonymous memory, so the next step's new pages come from recently freed ones.

    On a VM whose balloon driver reports free pages to the host (virtio free page reporting), a page that has
    been free for a few seconds costs the next process that touches it a host-side fault: writing 1 GB of new
    files measured 0.55-0.67 s right after memory was freed and 1.1-2.9 s after it was not (the step before had
    just filled the same tmpfs with `cp -a`). Which step got which pages depended on the order of the run, not
    on the tool; warming before every step gives each the same start.
    """
    if nbytes <= 0:
        return
    # In a child process: touched in the driver, the pages would count in every later step's ru_maxrss (a forked
    # process inherits its parent's high-water mark).
    subprocess.run([sys.executable, "-c", "import mmap, sys, numpy as np\n"
                    "m = mmap.mmap(-1, int(sys.argv[1]))\n"
                    "np.frombuffer(m, dtype=np.uint8)[::4096] = 1  # one write per page faults every page in\n",
                    str(nbytes)], check=True)


def measure(cmd: list[str], key: str = "cli") -> dict[str, Any]:
    """Run cmd to completion: its wall time, CPU seconds, peak RSS and bytes written, plus its last JSON line
    under `key` ("out" for our workers, whose `seconds` then replaces the process's wall time)."""
    warm_pages(WARM["bytes"])
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        w0, t0 = io_so_far(), time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        _, status, ru = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        written = io_since(w0)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{stderr[-3000:]}")
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    res = {"wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime, "max_rss": ru.ru_maxrss * 1024,
           "process_io": written}
    if lines:
        res[key] = json.loads(lines[-1])
    return res


def run_worker(name: str, **kw: Any) -> dict[str, Any]:
    return measure([sys.executable, __file__, "worker", name, json.dumps(kw)], key="out")


def fresh(path: Path) -> Path:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)
    return path


def copy_tree(src: Path, dst: Path) -> Path:
    subprocess.run(["cp", "-a", str(src), str(fresh(dst))], check=True)
    return dst


def prepare_dataset(args: argparse.Namespace, name: str, work: Path) -> tuple[Path, dict[str, Any]]:
    if name == "generator":
        key = f"gen-{args.config}-L{args.layers}-lr{args.lr:g}-s{args.shard_mb}"
    else:
        key = f"trained-{args.trained_params}-lr{args.trained_lr:g}-seed{args.trained_seed}"
    ds = work / key
    info_path = ds / "info.json"
    if not info_path.exists():
        print(f"[sync-bench] making data set {key} ...", file=sys.stderr)
        fresh(ds).mkdir(parents=True)
        kw = ({"config": args.config, "layers": args.layers, "lr": args.lr, "shard_mb": args.shard_mb}
              if name == "generator" else
              {"trained_py": args.trained_py, "params": args.trained_params, "lr": args.trained_lr,
               "seed": args.trained_seed, "warmup": args.trained_warmup})
        r = run_worker("dataset", kind=name, out=str(ds), **kw)
        info = {**r["out"], "generate_s": r["wall_s"], "generate_max_rss": r["max_rss"]}
        info["checkpoint_bytes"] = du(ds / "new")
        info_path.write_text(json.dumps(info, indent=1))
    return ds, json.loads(info_path.read_text())


def writer_fingerprint() -> str:
    """What made a template store: the installed deltafs's format version and the sources that decide its bytes.

    Templates are remade when it changes, so a pull is never measured on a store an older release wrote (an
    earlier run of this benchmark measured format v1 stores by reusing templates made before format v2).
    """
    import hashlib

    import deltafs
    from deltafs.format.manifest import FORMAT_VERSION

    root = Path(deltafs.__file__).parent
    h = hashlib.sha256()
    for sub in ("codec", "format", "publish"):
        for f in sorted((root / sub).glob("*.py")):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return f"deltafs {deltafs.__version__} format {FORMAT_VERSION} sources {h.hexdigest()[:16]}"


def make_older(base: Path, out: Path) -> None:
    """A version before base, for DEST's history: base with the lowest bit of every 997th tensor byte flipped.

    In blocks, not through a mapping: this process's RSS is inherited by every step it starts (ru_maxrss
    counts the pre-exec image of a fork), so it must stay small."""
    import numpy as np

    fresh(out).mkdir()
    block = 997 << 12
    for f in sorted(p for p in base.iterdir() if p.is_file()):
        shutil.copyfile(f, out / f.name)
        if f.suffix != ".safetensors":
            continue
        with open(out / f.name, "r+b") as fh:
            pos = 8 + struct.unpack("<Q", fh.read(8))[0]
            while chunk := os.pread(fh.fileno(), block, pos):
                data = np.frombuffer(chunk, np.uint8).copy()
                data[::997] ^= 1
                os.pwrite(fh.fileno(), data.tobytes(), pos)
                pos += len(chunk)


def prepare_deltafs(ds: Path) -> None:
    """tmpl-push/{store,cache}: the base pushed as version 1. tmpl-pull/{store,dest}: a store of an older
    version (make_older), the base and new as versions 1-3, and a DEST that pulled 1 then 2, as a host that
    follows a trainer has: the update pull of version 3 is the one measured, with the previous versions beside
    DEST as pull keeps them. Each measured run works on a cp -a of a template (untimed). Both are remade when
    the deltafs that would write them differs from the one that did (writer_fingerprint)."""
    cli = deltafs_cli()
    mark = writer_fingerprint()
    for t in (ds / "tmpl-push", ds / "tmpl-pull"):
        done = t / "done"
        if done.exists() and done.read_text() != mark:
            print(f"[sync-bench] {t.name}: written by {done.read_text() or 'an older deltafs'}; remaking", file=sys.stderr)
            fresh(t)
    push_t = ds / "tmpl-push"
    if not (push_t / "done").exists():
        fresh(push_t).mkdir()
        subprocess.run([cli, "push", str(ds / "base"), str(push_t / "store"), "--cache", str(push_t / "cache"), "-q"],
                       check=True)
        (push_t / "done").write_text(mark)
    pull_t = ds / "tmpl-pull"
    if not (pull_t / "done").exists():
        fresh(pull_t).mkdir()
        make_older(ds / "base", ds / "older")
        store, cache = pull_t / "store", ds / "tmpl-tmp-cache"
        for src in ("older", "base", "new"):
            subprocess.run([cli, "push", str(ds / src), str(store), "--cache", str(cache), "-q"], check=True)
        fresh(cache)
        fresh(ds / "older")
        for v in ("1", "2"):
            subprocess.run([cli, "pull", str(store), str(pull_t / "dest"), "--version", v, "-q"], check=True)
        (pull_t / "done").write_text(mark)


def bench_dataset(args: argparse.Namespace, name: str, work: Path,
                  on_row: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    ds, info = prepare_dataset(args, name, work)
    size = info["checkpoint_bytes"]
    base, new = ds / "base", ds / "new"
    prepare_deltafs(ds)
    WARM["bytes"] = int(args.warm_gib * 2**30) if args.warm_gib is not None else 2 * size + (512 << 20)
    run_dir = Path(args.scratch) / ds.name if args.scratch else ds / "run"
    fresh(run_dir).mkdir(parents=True)
    cli = deltafs_cli()
    rows: dict[str, Any] = {}

    def best(key: str, once: Callable[[], dict[str, Any]], check: Callable[[], bool | str] | None = None,
             drop: tuple[str, ...] = (), drop_after: tuple[str, ...] = ()) -> None:
        """Run `once` args.repeat times; keep the fastest (the run least disturbed by other processes).

        Each run starts with no dirty pages (sync, untimed), so one step's writeback is not charged to the next;
        `drop` names outputs removed after each run's check, `drop_after` inputs removed after the last run
        (keeps a tmpfs scratch small).
        """
        runs = []
        for _ in range(args.repeat):
            os.sync()
            r = once()
            if check is not None:
                r["identical"] = check()
            for d in drop:
                fresh(run_dir / d)
            runs.append(r)
        for d in drop_after:
            fresh(run_dir / d)
        r = min(runs, key=lambda x: x.get("out", {}).get("seconds", x["wall_s"]))
        r["seconds"] = r.get("out", {}).get("seconds", r["wall_s"])
        rows[key] = r
        if on_row is not None:  # the rows so far, in case the run is cut short (a time-limited machine)
            on_row({"dataset": info, "checkpoint_bytes": size, "rows": rows, "partial": True})
        print(f"[sync-bench] {name} {key}: {r['seconds']:.3f} s (process {r['wall_s']:.2f} s, "
              f"rss {r['max_rss'] / 2**20:.0f} MiB)", file=sys.stderr)

    best("cp -r", lambda: measure(["cp", "-r", str(new), str(fresh(run_dir / "cp"))]), drop=("cp",))
    for t in args.threads:
        def one_slime_publish() -> dict[str, Any]:
            out, tmp = fresh(run_dir / "slime-out"), fresh(run_dir / "slime-tmp")
            tmp.mkdir()
            return run_worker("slime_publish", slime_dir=args.slime_dir, base=str(base), new=str(new), out=str(out),
                              tmp=str(tmp), threads=t)

        def one_slime_apply() -> dict[str, Any]:
            local, tmp = fresh(run_dir / "slime-local"), fresh(run_dir / "slime-tmp")
            tmp.mkdir()
            return run_worker("slime_apply", slime_dir=args.slime_dir, patch=args.slime_patch, base=str(base),
                              source=str(run_dir / "slime-out"), local=str(local), tmp=str(tmp), threads=t)

        if args.slime_dir:
            best(f"slime publish t{t}", one_slime_publish)
            best(f"slime apply t{t}", one_slime_apply, lambda: same_tree(new, run_dir / "slime-local"),
                 drop=("slime-local", "slime-tmp"), drop_after=("slime-out",))
        best(f"xor+zstd-1 write t{t}", lambda: run_worker("xz_write", base=str(base), new=str(new),
                                                            out=str(fresh(run_dir / "xz-delta")), threads=t))
        best(f"xor+zstd-1 apply t{t}", lambda: run_worker("xz_apply", base=str(base), delta=str(run_dir / "xz-delta"),
                                                            out=str(fresh(run_dir / "xz-out")), threads=t),
             lambda: same_tree(new, run_dir / "xz-out"), drop=("xz-out",), drop_after=("xz-delta",))

        def push_run() -> Path:
            return copy_tree(ds / "tmpl-push", run_dir / "push")

        def pull_run() -> Path:
            return copy_tree(ds / "tmpl-pull", run_dir / "pull")

        def one_cli_push() -> dict[str, Any]:
            p = push_run()
            return measure([cli, "push", str(new), str(p / "store"), "--cache", str(p / "cache"), "--threads", str(t),
                            "--json"])

        def one_api_push() -> dict[str, Any]:
            p = push_run()
            return run_worker("api_push", store=str(p / "store"), new=str(new), cache=str(p / "cache"), threads=t)

        def one_api_push_beside() -> dict[str, Any]:
            # The cache on the checkpoint's own filesystem (the default ~/.cache and a checkpoint on the same
            # disk): push hard-links the new files instead of writing them. The cache's base is a copy, so it
            # holds the only link to the previous version, as when the trainer has deleted that checkpoint.
            p = fresh(run_dir / "push")
            p.mkdir()
            copy_tree(ds / "tmpl-push" / "store", p / "store")
            cache = copy_tree(ds / "tmpl-push" / "cache", ds / "run-cache")
            os.sync()
            return run_worker("api_push", store=str(p / "store"), new=str(new), cache=str(cache), threads=t)

        def one_cli_pull() -> dict[str, Any]:
            p = pull_run()
            return measure([cli, "pull", str(p / "store"), str(p / "dest"), "--threads", str(t), "--json"])

        def one_api_pull(recycle: bool = True) -> dict[str, Any]:
            p = pull_run()
            return run_worker("api_pull", store=str(p / "store"), dest=str(p / "dest"), threads=t, recycle=recycle)

        if not args.no_cli:
            best(f"deltafs push (CLI) t{t}", one_cli_push, drop=("push",))
        best(f"deltafs push (API) t{t}", one_api_push, drop=("push",))
        best(f"deltafs push (API, cache beside the checkpoint) t{t}", one_api_push_beside, drop=("push",))
        fresh(ds / "run-cache")
        if not args.no_cli:
            best(f"deltafs pull (CLI) t{t}", one_cli_pull, lambda: same_tree(new, run_dir / "pull" / "dest"),
                 drop=("pull",))
        best(f"deltafs pull (API) t{t}", one_api_pull, lambda: same_tree(new, run_dir / "pull" / "dest"), drop=("pull",))
        best(f"deltafs pull (API, new files) t{t}", lambda: one_api_pull(recycle=False),
             lambda: same_tree(new, run_dir / "pull" / "dest"), drop=("pull",))
    if not args.keep:
        fresh(run_dir)
    return {"dataset": info, "checkpoint_bytes": size, "rows": rows}


def machine() -> dict[str, Any]:
    mem = next(int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines()
               if ln.startswith("MemTotal:"))
    load = os.getloadavg()
    return {"cpus": os.cpu_count(), "mem_bytes": mem, "python": sys.version.split()[0],
            "loadavg_at_start": [round(x, 2) for x in load]}


def slime_commit(slime_dir: str | None) -> str | None:
    if not slime_dir:
        return None
    stamp = Path(slime_dir) / "COMMIT"  # the three files alone, as benchmarks/device_prepare.sh copies them
    if stamp.is_file():
        commit = stamp.read_text().strip()
    else:
        r = subprocess.run(["git", "-C", slime_dir, "rev-parse", "HEAD"], capture_output=True, text=True)
        commit = r.stdout.strip() if r.returncode == 0 else "unknown (not a git checkout)"
    if commit != SLIME_COMMIT_DOCUMENTED:
        print(f"[sync-bench] note: slime at {commit}; docs/sync_bench.md used {SLIME_COMMIT_DOCUMENTED}",
              file=sys.stderr)
    return commit


# --- py-spy summaries (docs/profile.md) ------------------------------------------------------------------
def _frames(stack: str) -> list[tuple[str, str]]:
    """'func (path:line)' frames, outermost first, as (func, path:line)."""
    out = []
    for fr in stack.split(";"):
        func, _, where = fr.rpartition(" (")
        out.append((func, where.rstrip(")")))
    return out


def _thread_role(head: str, frames: list[tuple[str, str]]) -> str:
    """Threads of one pool share a role: py-spy's thread name without its number ('deltafs-put_3' ->
    'deltafs-put') when it reports one, else 'main' or the function a pool worker was running."""
    import re

    name = head.partition("): ")[2]
    if name:
        return re.sub(r"_\d+$", "", name)
    runs = [i for i, (f, w) in enumerate(frames) if f.endswith("run") and "concurrent/futures/thread.py" in w]
    if not any("concurrent/futures/thread.py" in w for _, w in frames):
        return "main"
    if not runs or runs[-1] + 1 >= len(frames):
        return "pool: idle"
    return "pool: " + frames[runs[-1] + 1][0]


def profile_summary(path: str, rate: int, top: int) -> str:
    """Per thread role and per deepest frame: samples as seconds (py-spy raw format, --threads)."""
    from collections import Counter, defaultdict

    roles: Counter[str] = Counter()
    leaves: dict[str, Counter[str]] = defaultdict(Counter)
    ours: dict[str, Counter[str]] = defaultdict(Counter)
    threads: dict[str, set[str]] = defaultdict(set)
    for line in Path(path).read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        head, _, rest = stack.partition(";")
        frames = _frames(rest) if rest else []
        role = _thread_role(head, frames)
        count = int(n)
        roles[role] += count
        threads[role].add(head)
        func, where = frames[-1] if frames else ("?", "?")
        leaves[role][f"{func} ({where.split('site-packages/')[-1]})"] += count
        mine = [f"{f} ({w})" for f, w in frames if w.startswith(("deltafs/", "cli/")) or "/deltafs/" in w]
        ours[role][mine[-1] if mine else "(outside deltafs: " + func + ")"] += count
    out = [f"{path}: {sum(roles.values())} samples at {rate}/s per thread"]
    for role, n in roles.most_common():
        out.append(f"\n{role}: {n / rate:.2f} s over {len(threads[role])} thread(s)")
        out.append("  deepest frame:")
        out += [f"    {c / rate:7.2f} s  {k}" for k, c in leaves[role].most_common(top)]
        out.append("  deepest deltafs frame:")
        out += [f"    {c / rate:7.2f} s  {k}" for k, c in ours[role].most_common(top)]
    return "\n".join(out)


def cmd_profile_summary(args: argparse.Namespace) -> None:
    print(profile_summary(args.raw, args.rate, args.top))


# --- report -------------------------------------------------------------------------------------------------
def _anchor(rows: dict[str, Any], kind: str, t: str) -> dict[str, Any] | None:
    return rows.get(f"{kind} t{t}")


def _cpu(r: dict[str, Any]) -> float:
    """CPU seconds of the measured call (workers) or of the whole process (CLI, cp)."""
    return float(r.get("out", {}).get("cpu_s", r["cpu_s"]))


def table(res: dict[str, Any]) -> str:
    """Markdown: one row per step; ratios are this row's seconds over the anchor's (lower is faster)."""
    size = res["checkpoint_bytes"]
    rows = res["rows"]
    cp = rows["cp -r"]
    head = ("| step | threads | seconds | GB/s | stored bytes | written bytes | peak RSS | CPU s | x cp -r | x slime "
            "| x xor+zstd-1 | CPU x cp -r | CPU x slime | CPU x xor+zstd-1 |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    out = [head]
    for key, r in rows.items():
        label, _, t = key.rpartition(" t")
        if not label:
            label, t = key, "-"
        writer = any(w in label for w in ("publish", "write", "push"))
        slime = _anchor(rows, "slime publish" if writer else "slime apply", t)
        xz = _anchor(rows, "xor+zstd-1 write" if writer else "xor+zstd-1 apply", t)
        sec, cpu = r["seconds"], _cpu(r)
        o = r.get("out", {})
        stored = o.get("delta_bytes", o.get("result", r.get("cli", {})).get("bytes_written"))
        written = o.get("io", r.get("process_io", {})).get("wchar", 0)
        same = r.get("identical", True)
        note = "" if same is True else f" ({same})" if same else " (OUTPUT DIFFERS)"

        def ratio(x: float, anchor: dict[str, Any] | None, of: Callable[[dict[str, Any]], float]) -> str:
            return "-" if anchor is None else f"{x / of(anchor):.2f}"

        cells = [f"{label}{note}", t, f"{sec:.2f}", f"{size / sec / GB:.2f}",
                 "-" if stored is None else f"{stored / 1e6:.1f} MB", f"{written / 1e6:.1f} MB",
                 f"{o.get('peak_rss', r['max_rss']) / 2**20:.0f} MiB", f"{cpu:.2f}", f"{sec / cp['seconds']:.2f}",
                 ratio(sec, slime, lambda a: a["seconds"]), ratio(sec, xz, lambda a: a["seconds"]),
                 f"{cpu / _cpu(cp):.2f}", ratio(cpu, slime, _cpu), ratio(cpu, xz, _cpu)]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def report(results: dict[str, Any]) -> str:
    parts = [f"machine: {results['machine']}", f"slime: {results['slime_commit']}"]
    for name, res in results["datasets"].items():
        info = res["dataset"]
        parts.append(f"\n### {name}: {res['checkpoint_bytes'] / GB:.3f} GB, "
                     f"{info.get('changed_fraction', 0) * 100:.2f}% of elements changed ({info.get('kind')})\n")
        parts.append(table(res))
    return "\n".join(parts)


def precompile() -> str:
    """Write the bytecode of deltafs (and its CLI package) as `pip install` of a wheel does.

    An editable install compiles on first import and caches the result, unless PYTHONDONTWRITEBYTECODE is set
    (it is on the machines this project is measured on): then every process recompiled every deltafs module,
    ~0.24 s of each CLI row's start-up that no installed deltafs pays.
    """
    import importlib.util

    import deltafs

    roots = {str(Path(deltafs.__file__).parent)}
    spec = importlib.util.find_spec("deltafs.cli")
    if spec is not None and spec.origin:
        roots.add(str(Path(spec.origin).parent))
    subprocess.run([sys.executable, "-m", "compileall", "-q", *sorted(roots)], check=True, stdout=subprocess.DEVNULL)
    return "precompiled with compileall: " + ", ".join(sorted(roots))


def cmd_run(args: argparse.Namespace) -> None:
    args.threads = [int(x) for x in str(args.threads).split(",")]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"machine": machine(), "slime_commit": slime_commit(args.slime_dir),
                               "args": {k: v for k, v in vars(args).items() if k != "func"}, "datasets": {},
                               "bytecode": precompile()}

    def save_partial(name: str, partial: dict[str, Any]) -> None:
        if args.out:
            results["datasets"][name] = partial
            Path(args.out).write_text(json.dumps(results, indent=1))

    for name in args.datasets.split(","):
        results["datasets"][name] = bench_dataset(args, name, work, lambda p, name=name: save_partial(name, p))
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
    results["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(report(results))


def cmd_report(args: argparse.Namespace) -> None:
    print(report(json.loads(Path(args.json).read_text())))


def cmd_worker(args: argparse.Namespace) -> None:
    kw = json.loads(args.kwargs)
    if args.name == "dataset":
        out = Path(kw.pop("out"))
        kind = kw.pop("kind")
        res = make_generator_dataset(out, **kw) if kind == "generator" else make_trained_dataset(out, **kw)
    else:
        res = WORKERS[args.name](kw)
        res.update(_CPU)
    res["worker_max_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    res["peak_rss"] = vm_hwm()
    print(json.dumps(res))


def vm_hwm() -> int:
    """This process image's own peak RSS (VmHWM): ru_maxrss also counts what the forking driver had mapped."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(required=True)
    r = sub.add_parser("run", help="make the data sets (cached under --work) and measure every step")
    r.add_argument("--slime-dir", help="a checkout of THUDM/slime (see the module docstring); omit to skip slime")
    r.add_argument("--slime-patch", default=SLIME_PATCH, help="the pull_weights patch inside --slime-dir")
    r.add_argument("--work", default="/tmp/deltafs-sync-bench", help="data sets, stores and outputs go here")
    r.add_argument("--datasets", default="generator,trained", help="comma list: generator, trained")
    r.add_argument("--threads", default=str(min(os.cpu_count() or 1, 8)), help="comma list, e.g. 1,2,4,8,16")
    r.add_argument("--repeat", type=int, default=1, help="runs per step; the fastest is kept")
    r.add_argument("--config", default="llama-1b", help="generator model shapes (tiny, small, llama-1b)")
    r.add_argument("--layers", type=int, default=4, help="generator decoder layers (llama-1b: 4 -> ~1.0 GB bf16)")
    r.add_argument("--lr", type=float, default=9e-7, help="generator AdamW lr (llama-1b: 9e-7 -> ~2%% changed)")
    r.add_argument("--shard-mb", type=int, default=0, help="generator shard size (0: one model.safetensors)")
    r.add_argument("--trained-py", help="path of deltafs/testing/trained.py when the installed deltafs lacks it")
    r.add_argument("--trained-params", default="20M", help="trained data set size (deltafs.testing.trained)")
    r.add_argument("--trained-lr", type=float, default=1e-6, help="lr of the measured step (~1%% of bf16 changed)")
    r.add_argument("--trained-seed", type=int, default=0)
    r.add_argument("--trained-warmup", type=int, default=2)
    r.add_argument("--scratch", help="where measured steps write (stores, caches, outputs), e.g. a tmpfs to "
                   "measure the pipelines without the disk; default WORK/<data set>/run")
    r.add_argument("--warm-gib", type=float, help="GiB of memory touched and freed before every measured step "
                   "(see warm_pages; default twice the checkpoint plus 0.5; 0: off)")
    r.add_argument("--keep", action="store_true", help="keep the scratch directory at the end")
    r.add_argument("--no-cli", action="store_true", help="skip the CLI rows (the API rows time the same work)")
    r.add_argument("--out", help="write all results as JSON here")
    r.set_defaults(func=cmd_run)
    t = sub.add_parser("report", help="print the markdown tables of a --out JSON again")
    t.add_argument("json")
    t.set_defaults(func=cmd_report)
    p = sub.add_parser("profile-summary", help="seconds per thread role and frame from `py-spy record --format raw`")
    p.add_argument("raw")
    p.add_argument("--rate", type=int, default=100, help="the -r given to py-spy")
    p.add_argument("--top", type=int, default=12)
    p.set_defaults(func=cmd_profile_summary)
    w = sub.add_parser("worker", help=argparse.SUPPRESS)
    w.add_argument("name")
    w.add_argument("kwargs")
    w.set_defaults(func=cmd_worker)
    args = ap.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
