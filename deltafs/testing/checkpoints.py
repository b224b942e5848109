"""Small checkpoints for tests and demos, written byte by byte so every dtype and layout is reachable."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from typing import Mapping

import numpy as np

from deltafs.format.dtypes import nbytes


def write_safetensors(path: str, tensors: Mapping[str, tuple[str, tuple[int, ...], bytes]], *,
                      metadata: Mapping[str, str] | None = None, pad_header: int = 0) -> None:
    """Write name -> (dtype, shape, raw bytes) as a safetensors file, in the given order.

    pad_header appends spaces to the header JSON, as some writers do to align the data.
    """
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        assert len(data) == nbytes(dtype, shape), name
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode() + b" " * pad_header
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)))
        fh.write(text)
        for _dtype, _shape, data in tensors.values():
            fh.write(data)


def safetensors_layout(path: str) -> dict[str, tuple[str, int, int]]:
    """Tensor name -> (dtype, absolute byte offset in the file, nbytes), in header order (benchmarks and tests)."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    return {name: (m["dtype"], 8 + n + m["data_offsets"][0], m["data_offsets"][1] - m["data_offsets"][0])
            for name, m in header.items() if name != "__metadata__"}


def random_bytes(rng: np.random.Generator, n: int) -> bytes:
    return rng.integers(0, 256, size=n, dtype=np.uint8).tobytes()


def perturb(data: bytes, itemsize: int, fraction: float, rng: np.random.Generator) -> bytes:
    """Change about `fraction` of the elements by a small integer step of their bit pattern (like an optimizer step)."""
    arr = np.frombuffer(data, dtype=np.uint8).copy()
    if not arr.size:
        return data
    n = arr.size // itemsize
    count = max(1, int(n * fraction))
    idx = rng.choice(n, size=min(n, count), replace=False)
    view = arr[: n * itemsize].view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize])
    steps = rng.integers(1, 4, size=idx.size).astype(view.dtype)
    view[idx] = view[idx] + steps  # wraps modulo 2**bits: any bit pattern is fine
    return arr.tobytes()


DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
          "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "C64": 8, "F8_E8M0": 1}


class CheckpointMaker:
    """Builds successive versions of a small HF-like checkpoint directory."""

    def __init__(self, root: str | os.PathLike[str], seed: int = 0, shards: int = 1, fraction: float = 0.01) -> None:
        self.root = root
        self.rng = np.random.default_rng(seed)
        self.fraction = fraction
        shapes = {"model.embed_tokens.weight": ("BF16", (64, 48)), "model.layers.0.self_attn.q_proj.weight": ("BF16", (48, 48)),
                  "model.layers.0.mlp.up_proj.weight": ("F32", (96, 48)), "model.norm.weight": ("F32", (48,)),
                  "lm_head.weight": ("BF16", (64, 48)), "step": ("I64", ()), "empty": ("F16", (0, 5))}
        self.tensors = {n: (d, s, random_bytes(self.rng, _nb(d, s))) for n, (d, s) in shapes.items()}
        self.shards = shards
        self.step = 0

    def write(self, name: str | None = None) -> str:
        path = os.path.join(self.root, name or f"ckpt-{self.step}")
        names = list(self.tensors)
        per = -(-len(names) // self.shards)
        weight_map = {}
        for i in range(self.shards):
            part = {n: self.tensors[n] for n in names[i * per:(i + 1) * per]}
            fname = "model.safetensors" if self.shards == 1 else f"model-{i + 1:05d}-of-{self.shards:05d}.safetensors"
            write_safetensors(os.path.join(path, fname), part, metadata={"format": "pt"})
            weight_map.update({n: fname for n in part})
        if self.shards > 1:
            with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
                json.dump({"metadata": {}, "weight_map": weight_map}, fh)
        with open(os.path.join(path, "config.json"), "w") as fh:
            fh.write('{"architectures": ["LlamaForCausalLM"], "hidden_size": 48}\n')
        os.makedirs(os.path.join(path, "tokenizer"), exist_ok=True)
        with open(os.path.join(path, "tokenizer", "tokenizer.json"), "w") as fh:
            fh.write('{"version": "1.0", "step": %d}\n' % self.step)
        return path

    def advance(self) -> None:
        self.step += 1
        for n, (d, s, data) in list(self.tensors.items()):
            if n == "model.norm.weight" and self.step % 2:
                continue  # stays unchanged on odd steps
            self.tensors[n] = (d, s, perturb(data, DTYPES.get(d, 1), self.fraction, self.rng))


def _nb(dtype: str, shape: tuple[int, ...]) -> int:
    return nbytes(dtype, shape)


def run_cli(*args: object, env: dict[str, str] | None = None, check: int | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the real command line in a subprocess, as a user would."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-m", "deltafs.cli.main", *map(str, args)], capture_output=True, text=True,
                          env=full_env, timeout=timeout)
    if check is not None:
        assert proc.returncode == check, (proc.returncode, proc.stdout, proc.stderr)
    return proc


def files_of(path: str | os.PathLike[str]) -> dict[str, bytes]:
    out = {}
    for dirpath, _d, files in os.walk(path):
        for f in files:
            full = os.path.join(dirpath, f)
            out[os.path.relpath(full, path)] = open(full, "rb").read()
    return out


def file_digests(path: str | os.PathLike[str]) -> dict[str, str]:
    """Relative path -> sha256 of every file below path."""
    import hashlib

    root = os.fspath(path)
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as fh:
                out[os.path.relpath(full, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def race_pushes(url: str, options: dict[str, object], sources: list[str], version: int, cache_root: str,
                timeout: float = 300.0) -> dict[int, object]:
    """Push every source as the same version number at once; index -> PushResult or the exception it raised."""
    import threading

    from deltafs.publish import push

    barrier = threading.Barrier(len(sources))
    outcome: dict[int, object] = {}

    def pusher(i: int) -> None:
        barrier.wait(timeout=60)
        try:
            outcome[i] = push(url, sources[i], version=version, storage_options=options,
                              cache_dir=os.path.join(cache_root, f"racer-{i}"))
        except Exception as exc:  # noqa: BLE001 - the caller asserts on what each racer got
            outcome[i] = exc

    threads = [threading.Thread(target=pusher, args=(i,)) for i in range(len(sources))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    return outcome
