"""What a push publishes: default ignores, --include/--exclude, refusing a store or a DEST as SRC."""

from __future__ import annotations

import json
import os
import re

import pytest

from deltafs.errors import SourceError
from deltafs.publish import push
from deltafs.publish.select import selected
from deltafs.read import pull
from deltafs.testing.checkpoints import run_cli


@pytest.mark.parametrize("rel,published", [
    ("model.safetensors", True),
    ("config.json", True),
    ("tokenizer/tokenizer.json", True),
    (".cache/huggingface/download/model.safetensors.lock", False),
    (".cache/huggingface/download/model.safetensors.metadata", False),
    ("sub/.cache/x.json", False),
    (".git/HEAD", False),
    ("old.deltafs/v0000000001/model.safetensors", False),
    ("optimizer.pt", False),
    ("scheduler.pt", False),
    ("rng_state_3.pth", False),
    ("trainer_state.json", False),
    ("global_step100/mp_rank_00_model_states.pt", False),
])
def test_default_ignores(rel, published):
    assert selected(rel, None, None) is published
    assert selected(rel, None, None, default_excludes=False) is True


def test_include_and_exclude_globs():
    assert selected("model-00001-of-00002.safetensors", ["*.safetensors"], None)
    assert not selected("config.json", ["*.safetensors"], None)
    assert not selected("logs/run.txt", None, ["logs/*"])
    assert not selected("a/b/debug.json", None, ["debug.json"])  # a bare name matches at any depth
    assert selected("optimizer.pt", ["optimizer.pt"], None)  # an explicit include wins over a default ignore


def _checkpoint_with_clutter(maker):
    src = maker.write()
    os.makedirs(os.path.join(src, ".cache", "huggingface"))
    open(os.path.join(src, ".cache", "huggingface", "model.safetensors.lock"), "w").close()
    with open(os.path.join(src, "optimizer.pt"), "wb") as fh:
        fh.write(os.urandom(50_000))
    os.makedirs(os.path.join(src, "logs"))
    open(os.path.join(src, "logs", "run.txt"), "w").write("loss 1.0\n")
    return src


def test_push_skips_clutter_and_reports_bytes_per_file(tmp_path, maker):
    src = _checkpoint_with_clutter(maker)
    out = json.loads(run_cli("push", src, tmp_path / "store", "--exclude", "logs/*", "--json", check=0).stdout)
    assert set(out["files"]) == {"config.json", "model.safetensors", "tokenizer/tokenizer.json"}
    pull(str(tmp_path / "store"), str(tmp_path / "dest"))
    assert not os.path.exists(tmp_path / "dest" / "optimizer.pt")


def test_a_dominating_non_weight_file_is_named(tmp_path, maker):
    src = _checkpoint_with_clutter(maker)
    proc = run_cli("push", src, tmp_path / "store", "--no-default-excludes", check=0)
    assert "optimizer.pt is" in proc.stdout and "% of the stored bytes" in proc.stdout


def test_the_share_of_a_file_counts_a_payload_two_files_share_once(tmp_path, maker):
    """Two identical optimizer shards are one stored object: each is most of what the version stores."""
    src = maker.write()
    blob = os.urandom(300_000)
    for name in ("optim.0.pt", "optim.1.pt"):
        with open(os.path.join(src, name), "wb") as fh:
            fh.write(blob)
    proc = run_cli("push", src, tmp_path / "store", "--no-default-excludes", check=0)
    share = re.search(r"optim\.[01]\.pt is (\d+)% of the stored bytes", proc.stdout)
    assert share is not None and int(share.group(1)) >= 50, proc.stdout


def test_swapped_arguments_and_nested_stores(tmp_path, maker):
    src = maker.write()
    store = tmp_path / "store"
    run_cli("push", src, store, "-q", check=0)
    swapped = run_cli("push", store, tmp_path / "other")
    assert swapped.returncode != 0 and "is a deltafs store" in swapped.stderr and len(swapped.stderr.splitlines()) == 1
    assert not os.path.exists(tmp_path / "other")
    into_ckpt = run_cli("push", src, maker.write("elsewhere"), check=0)
    assert "looks like a checkpoint directory" in into_ckpt.stderr
    nested = os.path.join(src, "store")
    first = run_cli("push", src, nested, check=0)
    assert "is inside the source" in first.stderr
    second = json.loads(run_cli("push", src, nested, "--json", check=0).stdout)
    assert not any(p.startswith("store/") for p in second["files"])


def test_a_pulled_dest_is_not_a_source(tmp_path, maker):
    store, dest = str(tmp_path / "store"), str(tmp_path / "dest")
    push(store, maker.write())
    pull(store, dest)
    with pytest.raises(SourceError, match="pull destination"):
        push(str(tmp_path / "store2"), dest)


def test_a_pulled_dest_is_not_a_store(tmp_path, maker):
    """`deltafs push SRC DEST` (a pulled DEST as STORE) only warned: the store was written into the version
    directory an engine served, and the next pull's repair deleted it as files foreign to that version. Refused,
    exit 2, before anything is written; so is a store path inside DEST's sidecar."""
    store, dest = str(tmp_path / "store"), str(tmp_path / "dest")
    push(store, maker.write())
    pull(store, dest)
    served = os.path.realpath(dest)
    before = sorted(os.listdir(served))
    for target in (dest, f"{dest}.deltafs/store", f"file://{dest}", f"local://{dest}", f"local://{dest}.deltafs/s"):
        proc = run_cli("push", maker.write("next"), target)
        assert proc.returncode == 2, proc.stderr
        assert f"is inside {dest}.deltafs, where deltafs keeps the versions pulled into {dest}" in proc.stderr
        # One line: "looks like a checkpoint directory (are SRC and STORE swapped?)" came first, pointing the wrong way.
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    from deltafs.errors import UsageError
    from deltafs.store.repo import Repository

    os.makedirs(f"{dest}.deltafs/made")
    with pytest.raises(UsageError, match="is inside"):  # a Repository object (the Python API) as well
        push(Repository.open(f"{dest}.deltafs/made", create=True), maker.write("next"))
    assert sorted(os.listdir(served)) == before and not os.path.exists(f"{dest}.deltafs/store")
    assert not os.path.exists(f"{dest}.deltafs/s")
    assert run_cli("pull", store, dest, "--once").returncode == 100  # DEST untouched


def test_a_directory_merely_named_like_a_sidecar_is_a_store_like_any(tmp_path, maker):
    """X.deltafs counted as a DEST's sidecar whenever X was a symlink to anywhere: `stores/run7` linking to
    `run7.deltafs` (a store's own alias), or `proj -> /tmp` beside `proj.deltafs/store`, refused the push (and a pull
    into such a path). A sidecar is one that its DEST links into, or that holds DEST's lock."""
    stores = tmp_path / "stores"
    (stores / "run7.deltafs").mkdir(parents=True)
    os.symlink("run7.deltafs", stores / "run7")
    assert run_cli("push", maker.write(), stores / "run7.deltafs", "-q").returncode == 0
    os.symlink(tmp_path / "stores", tmp_path / "proj")
    assert run_cli("push", maker.write(), tmp_path / "proj.deltafs" / "store", "-q").returncode == 0
    assert run_cli("pull", stores / "run7.deltafs", tmp_path / "proj.deltafs" / "dest", "-q").returncode == 0
