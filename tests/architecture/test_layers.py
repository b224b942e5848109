"""The package layers of docs/architecture.md: imports only point down, and no module import cycle.

Reads every module under deltafs/ and cli/ with `ast` (nothing is imported), so an upward import or a
cycle added anywhere fails here with the offending file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Lower rank = lower layer. A module may import its own package and packages of a strictly lower rank.
LAYERS: dict[str, int] = {
    "errors": 0, "checksum": 0, "parallel": 0, "progress": 0, "metrics": 0, "defaults": 0, "buffers": 0,
    "format": 1, "codec": 1,
    "store": 2,
    "read": 3,
    "publish": 4, "maintenance": 4,
    "engines": 5, "integrations": 5,
    "watch": 6, "testing": 6,
    "cli": 7,
}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in sorted((ROOT / "deltafs").rglob("*.py")):
        rel = path.relative_to(ROOT / "deltafs").with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        found[".".join(["deltafs", *parts])] = path
    for path in sorted((ROOT / "cli").glob("*.py")):
        name = path.stem
        found["deltafs.cli" + ("" if name == "__init__" else "." + name)] = path
    return found


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _imports(path: Path, module: str) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level outside TYPE_CHECKING) for every deltafs import."""
    tree = ast.parse(path.read_text(), str(path))
    out: list[tuple[str, int, bool]] = []
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                for inner in ast.walk(sub):
                    type_only.add(id(inner))
    top_level = {id(n) for n in tree.body}
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            if name == "deltafs" or name.startswith("deltafs."):
                out.append((name, node.lineno, id(node) in top_level and id(node) not in type_only))
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _upward(edges: list[tuple[str, str, str]]) -> list[str]:
    """The edges (importer, imported, where) that do not point to a strictly lower layer."""
    problems = []
    for module, target, where in edges:
        own, other = _layer(module), _layer(target)
        if own is None or other is None or other == own:
            continue
        assert own in LAYERS, f"{where}: package {own!r} has no layer in tests/architecture/test_layers.py"
        if LAYERS[other] >= LAYERS[own]:
            problems.append(f"{where}: {own} (layer {LAYERS[own]}) imports {target} (layer {LAYERS[other]})")
    return problems


def test_imports_point_down() -> None:
    modules = _modules()
    edges = []
    for module, path in modules.items():
        for name, line, _ in _imports(path, module):
            target = _resolve(name, modules)
            if target is not None:
                edges.append((module, target, f"{path.relative_to(ROOT)}:{line}"))
    problems = _upward(edges)
    assert not problems, "upward or sideways imports:\n" + "\n".join(problems)


def test_no_import_cycles() -> None:
    """Module-level imports (the ones that run at import time) form no cycle, within a package or across."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for name, _, runtime in _imports(path, module):
            target = _resolve(name, modules)
            if runtime and target and target != module and not module.startswith(target + "."):
                graph[module].add(target)
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_function_level_cycles_between_modules() -> None:
    """Deferred imports inside functions may not close a cycle either (folds <-> rebuild was one)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        if _layer(module) is None or _layer(module) == "cli":
            continue
        for name, _, _ in _imports(path, module):
            target = _resolve(name, modules)
            if target and target != module and not module.startswith(target + ".") and _layer(target) is not None:
                if not target.endswith("__init__") and target.count(".") >= 2:
                    graph[module].add(target)
    cycles = _cycles(graph)
    assert not cycles, "import cycles through deferred imports:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of size > 1 (or a self loop)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checks_catch_violations() -> None:
    """The checkers themselves fail on a planted upward import and a planted cycle."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert _upward([("deltafs.store.base", "deltafs.read.pull", "x.py:1")])
    assert _upward([("deltafs.read.pull", "deltafs.publish.push", "x.py:2")])
    assert not _upward([("deltafs.cli.core", "deltafs.read.pull", "x.py:3")])


def test_the_facade_lists_what_it_exports() -> None:
    import deltafs

    assert set(deltafs.__all__) == {"__version__", *deltafs._EXPORTS}
    for name in deltafs._EXPORTS:
        assert getattr(deltafs, name) is not None
