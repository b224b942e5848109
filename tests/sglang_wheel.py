"""Find the pinned SGLang wheel and pull source text out of it (never imported as a package).

scripts/setup.sh downloads the wheel (no dependencies, ~39 MB) into .cache/sglang-wheel/; set
DELTAFS_SGLANG_WHEEL to use another copy. Importing sglang on a CPU machine drags in CUDA packages,
so tests read its files as text and execute single functions and classes taken out with `ast`.
"""

from __future__ import annotations

import ast
import functools
import glob
import os
import textwrap
import zipfile

import pytest

SGLANG_VERSION = "0.5.23"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE_DIR = os.path.join(REPO_ROOT, ".cache", "sglang-wheel")


def find_wheel() -> str | None:
    explicit = os.environ.get("DELTAFS_SGLANG_WHEEL")
    if explicit:
        return explicit if os.path.isfile(explicit) else None
    found = sorted(glob.glob(os.path.join(CACHE_DIR, f"sglang-{SGLANG_VERSION}-*.whl")))
    return found[0] if found else None


def require_wheel() -> str:
    """The wheel's path; a test without it is skipped locally and fails in CI (CI must fetch it)."""
    wheel = find_wheel()
    if wheel is None:
        why = (f"the sglang {SGLANG_VERSION} wheel is not in {CACHE_DIR}; run scripts/setup.sh "
               f"(pip download --no-deps sglang=={SGLANG_VERSION}) or set DELTAFS_SGLANG_WHEEL")
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return wheel


@functools.cache
def source(member: str) -> str:
    """The text of one file of the wheel, e.g. "sglang/srt/utils/auth.py"."""
    with zipfile.ZipFile(require_wheel()) as zf:
        return zf.read(member).decode()


def _segment(lines: list[str], node: ast.AST) -> str:
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return textwrap.dedent("\n".join(lines[first - 1:node.end_lineno])) + "\n"


@functools.cache
def _tree(member: str) -> ast.Module:
    return ast.parse(source(member))


def extract(member: str, names: list[str], *, cls: str | None = None) -> str:
    """The source (decorators included) of top-level definitions, or of methods of class cls.

    Fails loudly when a name is missing: a moved pin must not silently test less.
    """
    tree = _tree(member)
    lines = source(member).splitlines()
    body = tree.body
    if cls is not None:
        owners = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
        assert owners, f"class {cls} not found in {member}"
        body = owners[0].body
    found: dict[str, str] = {}
    for node in body:
        name = getattr(node, "name", None)
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
        if name in names and name not in found:
            found[name] = _segment(lines, node)
    missing = [n for n in names if n not in found]
    assert not missing, f"{missing} not found in {member}{' class ' + cls if cls else ''}"
    return "".join(found[n] for n in names)


def class_fields(member: str, cls: str) -> dict[str, str]:
    """Annotated fields of a class (inherited ones not included): name -> annotation source."""
    for node in _tree(member).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {s.target.id: ast.unparse(s.annotation) for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    raise AssertionError(f"class {cls} not found in {member}")
