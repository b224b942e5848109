"""Regenerate manifests/examples/ from a tiny real push (run after a format or codec change).

The examples are the JSON text of each manifest; the store keeps a v2 manifest as one zstd frame of it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "manifests", "examples")


def main() -> None:
    from deltafs.format.manifest import manifest_json, manifest_key
    from deltafs.publish import push
    from deltafs.store.repo import Repository
    from deltafs.testing.checkpoints import CheckpointMaker

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["DELTAFS_CACHE"] = os.path.join(tmp, "cache")
        store = os.path.join(tmp, "store")
        Repository.open(store, create=True, chunk_bytes=4096)
        maker = CheckpointMaker(os.path.join(tmp, "src"), seed=42, fraction=0.02)
        push(store, maker.write(), metadata={"step": 0})
        maker.advance()
        push(store, maker.write(), metadata={"step": 1})
        os.makedirs(OUT, exist_ok=True)
        for version, name in ((1, "full.json"), (2, "delta.json")):
            with open(os.path.join(store, manifest_key(version)), "rb") as fh:
                data = json.loads(manifest_json(fh.read()))  # stored as zstd; the examples show the JSON
            with open(os.path.join(OUT, name), "w") as fh:
                json.dump(data, fh, indent=1, sort_keys=True)
                fh.write("\n")
        shutil.copy(os.path.join(store, "deltafs.json"), os.path.join(OUT, "deltafs.json"))
        shutil.copy(os.path.join(store, "HEAD"), os.path.join(OUT, "HEAD"))
    print(f"wrote {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
