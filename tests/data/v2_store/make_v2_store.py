"""Write the small format-v2 store kept in tests/data/v2_store (run once, with deltafs at d4f1857: format 2, before packs).

    git worktree add /tmp/v02 d4f1857
    PYTHONPATH=/tmp/v02 python tests/data/v2_store/make_v2_store.py OUT
"""
import hashlib, json, os, sys
import deltafs
assert deltafs.__file__.startswith("/tmp/v02/"), deltafs.__file__
from deltafs.publish import push
from deltafs.store.repo import Repository
from deltafs.testing.checkpoints import CheckpointMaker, file_digests

out = sys.argv[1]
store = os.path.join(out, "store")
Repository.open(store, create=True, chunk_bytes=4096)
maker = CheckpointMaker(os.path.join("/tmp/v2gen", "src"), seed=7, shards=2, fraction=0.05)
expected = {}
for step in range(4):
    src = maker.write()
    res = push(store, src, cache_dir="/tmp/v2gen/cache", fold=True, keyframe_every=None, keyframe_budget=None,
               metadata={"step": str(step)})
    expected[str(res.version)] = file_digests(src)
    maker.advance()
with open(os.path.join(out, "expected_sha256.json"), "w") as fh:
    json.dump(expected, fh, indent=1, sort_keys=True)
