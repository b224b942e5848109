"""What a push and a pull spend on one manifest of a large model, by step: a synthetic manifest of N chunk records.

    python benchmarks/manifest_scale.py --records 35000 --rounds 3

A 70B model in 4 MiB chunks has ~35,000 chunk records per version (a 1T model ~500,000). The manifest here is one
safetensors file of tensors of 32 chunks, each chunk a sparse-codec record like a trainer step's. Timed, least of
--rounds: a push's `sealed()` (digest, the invariants and the canonical JSON it commits and installs, in one
encode; before round 6 `seal()` then `checked()`, two, timed apart) and `encode()` (the zstd frame); a pull's
`Manifest.decode()` of the stored bytes in a process that has not seen them (parse, build, digest, invariants),
then its `to_bytes()` (the JSON the install embeds in DEST's state record); writing the DEST state record, and
checking a record as cleanup and recycling do to order versions (`_is_state`), and reading it back in full, both
in a process that has not seen it; and reading it in a process that has decoded its manifest from the store (as a
push reads its cache's record after HEAD's manifest).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time

from deltafs.format import manifest as mod
from deltafs.format.manifest import ChunkRef, FileEntry, Manifest, Segment
from deltafs.format.records import dest_state_bytes, dest_state_record
from deltafs.read import dest

PER_TENSOR = 32
CHUNK = 4 << 20


def synthetic(records: int) -> Manifest:
    codec = {"name": "sparse", "width": 2, "split": 0, "frames": [5000, 20000, 3300, 80, 190, 300, 300],
             "groups": [{"count": 27000, "rice": 6, "unary": 7000, "big": 300, "big_rice": 5, "big_unary": 80}]}
    header = 8 + 4096
    segs = [Segment("h:model.safetensors", "header", 0, header, "xxh3-tree:" + "ef" * 16,
                    (ChunkRef(0, header, {"name": "same"}, None, 0),))]
    off = header
    for t in range(max(1, records // PER_TENSOR)):
        chunks = tuple(ChunkRef(i, CHUNK, dict(codec), hashlib.sha256(f"{t}-{i}".encode()).hexdigest(), 31000)
                       for i in range(PER_TENSOR))
        segs.append(Segment(f"t:model.layers.{t}.mlp.weight", "tensor", off, PER_TENSOR * CHUNK,
                            "xxh3-tree:" + "ab" * 16, chunks, "BF16", (PER_TENSOR * CHUNK // 2,)))
        off += PER_TENSOR * CHUNK
    f = FileEntry("model.safetensors", off, "xxh3-tree:" + "cd" * 16, "safetensors", tuple(segs))
    return Manifest(store_id="0" * 32, version=2, parent=1, parent_digest="sha256:" + "0" * 64, kind="delta",
                    chunk_bytes=CHUNK, created="2026-12-01T00:00:00.000000Z", files=(f,), metadata={}, stats={})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=35000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    base = synthetic(args.records)
    best: dict[str, float] = {}
    size = (0, 0)
    for _ in range(args.rounds):
        with mod._CHECKED_LOCK:
            mod._CHECKED.clear()
        times = {}
        t = time.perf_counter()
        base.seal().checked()
        times["(before round 6) seal() + checked()"] = time.perf_counter() - t
        with mod._CHECKED_LOCK:
            mod._CHECKED.clear()
        t = time.perf_counter()
        man = base.sealed()
        times["push: sealed() (digest, checks, the canonical JSON)"] = time.perf_counter() - t
        text = man.to_bytes()
        t = time.perf_counter()
        stored = man.encode()
        times["push: encode() (zstd)"] = time.perf_counter() - t
        with mod._CHECKED_LOCK:
            mod._CHECKED.clear()
        t = time.perf_counter()
        pulled = Manifest.decode(stored)
        times["pull: decode() in a new process"] = time.perf_counter() - t
        t = time.perf_counter()
        pulled.to_bytes()
        times["pull: to_bytes() (the DEST state record embeds it)"] = time.perf_counter() - t
        # The DEST state record beside every installed version (pull's DEST, push's cache) embeds the manifest.
        t = time.perf_counter()
        record = dest_state_record(store_id=pulled.store_id, store_url="file:///store", version=pulled.version,
                                   digest=pulled.digest, files={"model.safetensors": [1, 2]})
        state = dest_state_bytes(record, pulled.to_bytes())
        times["install: the DEST state record"] = time.perf_counter() - t
        with tempfile.TemporaryDirectory() as tmp:
            vdir = os.path.join(tmp, "v0000000002-00000000")
            with open(vdir + ".json", "wb") as fh:
                fh.write(state)
            with mod._CHECKED_LOCK:
                mod._CHECKED.clear()
            dest._STATE_MEMO.clear()
            t = time.perf_counter()
            ok = dest._is_state(vdir + ".json")
            times["read: order by a DEST state record (cleanup, recycling), new process"] = time.perf_counter() - t
            assert ok
            t = time.perf_counter()
            dest.read_version_state(vdir)
            times["read: a DEST state record in a new process"] = time.perf_counter() - t
            # A push decodes the cache's version from the store (HEAD) before it reads the cache's state record.
            dest._STATE_MEMO.clear()
            with mod._CHECKED_LOCK:
                mod._CHECKED.clear()
            Manifest.decode(stored)
            t = time.perf_counter()
            dest.read_version_state(vdir)
            times["read: a DEST state record whose manifest this process checked (a push's cache)"] = \
                time.perf_counter() - t
        size = (len(text), len(stored))
        for k, v in times.items():
            best[k] = min(best.get(k, v), v)
    print(f"{args.records} chunk records: canonical JSON {size[0] / 1e6:.1f} MB, stored {size[1] / 1e6:.2f} MB")
    print("| step | seconds |\n|---|---|")
    for k, v in best.items():
        print(f"| {k} | {v:.3f} |")
    for side in ("push", "pull", "install", "read"):
        print(f"| {side} total | {sum(v for k, v in best.items() if k.startswith(side)):.3f} |")


if __name__ == "__main__":
    main()
