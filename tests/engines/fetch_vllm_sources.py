"""Fetch the pinned vLLM wheel (no dependencies) and extract the source text the vLLM tests read.

The wheel is ~336 MB, too big to download in every CI run, so the few files (and, from large files,
the few functions) that the tests parse or execute are committed under
tests/engines/data/vllm-<version>/ as .py.txt, with vLLM's license (Apache-2.0) beside them. This
script re-creates that copy (e.g. when moving the pin) or, with --check, confirms it is identical to
what the wheel gives. The wheel is cached, never committed, and never imported: importing vllm on a
CPU machine drags in CUDA packages.

A whole file is copied byte for byte. From a large file only the named functions are kept: each is
cut out with ast (its exact source lines, dedented), under the file's SPDX header and a comment
naming where it came from.

    python tests/engines/fetch_vllm_sources.py            # extract into tests/engines/data/
    python tests/engines/fetch_vllm_sources.py --check    # exit 1 if the committed copy differs
"""

from __future__ import annotations

import argparse
import ast
import glob
import os
import subprocess
import sys
import textwrap
import zipfile

VLLM_VERSION = "0.33.0"
# member -> (file name under data/, None for the whole file or the qualified names to keep)
MEMBERS: dict[str, tuple[str, tuple[str, ...] | None]] = {
    "vllm/entrypoints/rl/online/api_router.py": ("rl_online_api_router.py.txt", None),
    "vllm/entrypoints/serve/dev/rpc/api_router.py": ("dev_rpc_api_router.py.txt", None),
    "vllm/entrypoints/serve/__init__.py": ("serve_init.py.txt", None),
    "vllm/entrypoints/launchers/api_server/routers.py": ("launchers_routers.py.txt", None),
    "vllm/entrypoints/serve/middleware/authenticate.py": ("middleware_authenticate.py.txt", None),
    "vllm/model_executor/model_loader/reload/inplace.py": ("reload_inplace.py.txt", None),
    "vllm/model_executor/model_loader/weight_checksum.py": ("weight_checksum.py.txt", None),
    "vllm/v1/engine/__init__.py": ("v1_engine_init.py.txt", ("PauseMode",)),
    "vllm/v1/worker/gpu_worker.py": ("gpu_worker.py.txt", ("Worker.reload_weights",)),
    "vllm/v1/worker/gpu_model_runner.py": ("gpu_model_runner.py.txt", ("GPUModelRunner.reload_weights",)),
    "vllm/v1/worker/gpu/model_runner.py": ("gpu_v2_model_runner.py.txt", ("GPUModelRunner.reload_weights",)),
    "vllm/v1/metrics/loggers.py": ("metrics_loggers.py.txt", ("PrometheusStatLogger.__init__",)),
}
LICENSE_MEMBER = f"vllm-{VLLM_VERSION}.dist-info/licenses/LICENSE"
HERE = os.path.dirname(os.path.abspath(__file__))
DATA_DIR = os.path.join(HERE, "data", f"vllm-{VLLM_VERSION}")


def fetch_wheel(cache_dir: str) -> str:
    """The cached wheel's path, downloading it first if needed."""
    pattern = os.path.join(cache_dir, f"vllm-{VLLM_VERSION}-*.whl")
    found = glob.glob(pattern)
    if found:
        return found[0]
    os.makedirs(cache_dir, exist_ok=True)
    # Pin platform and Python so the same wheel is picked whatever interpreter runs this.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.11", "--platform", "manylinux_2_28_x86_64",
           f"vllm=={VLLM_VERSION}", "-d", cache_dir, "--quiet"]
    subprocess.run(cmd, check=True)
    found = glob.glob(pattern)
    if not found:
        raise SystemExit(f"pip did not produce a vllm {VLLM_VERSION} wheel in {cache_dir}")
    return found[0]


def _find(tree: ast.Module, qualname: str) -> ast.stmt:
    """The top-level statement (class.method for methods, or an assignment target) named qualname."""
    scope: list[ast.stmt] = tree.body
    parts = qualname.split(".")
    for depth, part in enumerate(parts):
        for node in scope:
            name = getattr(node, "name", None)
            if name is None and isinstance(node, ast.Assign):
                name = next((t.id for t in node.targets if isinstance(t, ast.Name)), None)
            if name == part:
                if depth == len(parts) - 1:
                    return node
                scope = node.body  # type: ignore[attr-defined]
                break
        else:
            raise SystemExit(f"{qualname} not found")
    raise AssertionError("unreachable")


def excerpt(member: str, source: bytes, names: tuple[str, ...]) -> bytes:
    """The file's SPDX header, then each named definition's exact lines, dedented."""
    text = source.decode("utf-8")
    lines = text.splitlines(keepends=True)
    tree = ast.parse(text)
    header = [ln for ln in lines[:5] if ln.startswith("# SPDX-")]
    out = header + [f"# Excerpt of {member} from vllm {VLLM_VERSION}, made by tests/engines/fetch_vllm_sources.py.\n"]
    for name in names:
        node = _find(tree, name)
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        out.append(f"\n# {name}: lines {start}-{node.end_lineno}\n")
        out.append(textwrap.dedent("".join(lines[start - 1:node.end_lineno])))
    return "".join(out).encode("utf-8")


def wanted_files(wheel: str) -> dict[str, bytes]:
    """File name under data/ -> the bytes it must hold."""
    out: dict[str, bytes] = {}
    with zipfile.ZipFile(wheel) as zf:
        for member, (name, names) in MEMBERS.items():
            data = zf.read(member)
            out[name] = data if names is None else excerpt(member, data, names)
        out["LICENSE.txt"] = zf.read(LICENSE_MEMBER)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "deltafs-vllm-wheel"))
    parser.add_argument("--out", default=DATA_DIR)
    parser.add_argument("--check", action="store_true", help="compare with the files in --out instead of writing")
    args = parser.parse_args()
    wheel = fetch_wheel(args.cache_dir)
    differ = []
    for name, data in wanted_files(wheel).items():
        target = os.path.join(args.out, name)
        if args.check:
            try:
                with open(target, "rb") as fh:
                    same = fh.read() == data
            except FileNotFoundError:
                same = False
            if not same:
                differ.append(target)
        else:
            os.makedirs(args.out, exist_ok=True)
            with open(target, "wb") as fh:
                fh.write(data)
    if differ:
        print("differs from the vllm wheel: " + ", ".join(differ), file=sys.stderr)
        return 1
    print(f"{'checked' if args.check else 'extracted'} {len(MEMBERS) + 1} files of vllm {VLLM_VERSION} ({os.path.basename(wheel)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
