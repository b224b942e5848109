"""Every field and route the SGLang adapter uses exists in a pinned SGLang release.

SGLang accepts unknown JSON fields silently, so a misspelled field ("weights_version") would be
ignored at run time. The request types are read from the release's own wheel (tests/sglang_wheel.py:
parsed with ast, never imported; scripts/setup.sh downloads it into .cache/).
"""

from __future__ import annotations

import ast

import pytest
from sglang_wheel import SGLANG_VERSION, source

from deltafs.engines import sglang
from deltafs.engines.base import Target

MEMBERS = {
    "io_struct.py.txt": "sglang/srt/managers/io_struct.py",
    "http_server.py.txt": "sglang/srt/entrypoints/http_server.py",
    "v1_loads.py.txt": "sglang/srt/entrypoints/v1_loads.py",
    "load_snapshot.py.txt": "sglang/srt/managers/load_snapshot.py",
    "weight_checker.py": "sglang/srt/utils/weight_checker.py",
}


def _source(name: str) -> ast.Module:
    return ast.parse(source(MEMBERS[name]), filename=MEMBERS[name])


def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def declared_fields(tree: ast.Module, name: str) -> dict[str, ast.AnnAssign]:
    """Annotated class attributes of `name` and of its bases declared in the same file."""
    classes = _classes(tree)
    cls = classes[name]
    out: dict[str, ast.AnnAssign] = {}
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            out.update(declared_fields(tree, base.id))
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            out[stmt.target.id] = stmt
    return out


def literal_values(ann: ast.AnnAssign) -> set[str]:
    """The strings of a Literal["a", "b"] annotation."""
    node = ann.annotation
    assert isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Literal"
    elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    return {e.value for e in elts if isinstance(e, ast.Constant)}


def routes(tree: ast.Module) -> set[tuple[str, str]]:
    """(method, path) of every @app.get/@app.post/@router.get/@app.api_route decorator."""
    out = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in node.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.args):
                continue
            path = dec.args[0]
            if not isinstance(path, ast.Constant):
                continue
            if dec.func.attr in ("get", "post"):
                out.add((dec.func.attr.upper(), path.value))
            elif dec.func.attr == "api_route":
                for kw in dec.keywords:
                    if kw.arg == "methods" and isinstance(kw.value, ast.List):
                        out.update((e.value, path.value) for e in kw.value.elts if isinstance(e, ast.Constant))
    return out


TARGET = Target(path="/models/current.deltafs/v0000000042-abcd", version="42")


@pytest.mark.parametrize(
    "type_name, body",
    [
        ("PauseGenerationReqInput", sglang.pause_body("retract")),
        ("UpdateWeightFromDiskReqInput", sglang.update_body(TARGET)),
        ("ContinueGenerationReqInput", sglang.continue_body()),
        ("UpdateWeightFromDiskReqInput", sglang.update_body(TARGET, flush_cache=False)),
        ("CheckWeightsReqInput", sglang.checksum_body()),
    ],
)
def test_every_sent_field_is_declared(type_name: str, body: dict[str, object]) -> None:
    fields = declared_fields(_source("io_struct.py.txt"), type_name)
    unknown = sorted(set(body) - set(fields))
    assert not unknown, f"{type_name} in sglang {SGLANG_VERSION} has no field(s) {unknown}; declared: {sorted(fields)}"


def test_update_sends_the_fields_the_watcher_relies_on() -> None:
    # The test above cannot fail on a field the adapter forgot; pin the ones the design needs.
    body = sglang.update_body(TARGET)
    assert body == {"model_path": TARGET.path, "weight_version": "42", "flush_cache": True}


def test_every_pause_mode_is_one_sglang_accepts() -> None:
    fields = declared_fields(_source("io_struct.py.txt"), "PauseGenerationReqInput")
    assert set(sglang.PAUSE_MODES) == literal_values(fields["mode"])


def test_the_field_check_catches_a_misspelling() -> None:
    fields = declared_fields(_source("io_struct.py.txt"), "UpdateWeightFromDiskReqInput")
    assert "weight_version" in fields and "weights_version" not in fields
    assert {"rid", "http_worker_ipc"} <= set(fields)  # inherited from BaseReq


def test_every_route_the_adapter_calls_exists() -> None:
    declared = routes(_source("http_server.py.txt")) | routes(_source("v1_loads.py.txt"))
    used = {("POST", sglang.PAUSE_ROUTE), ("POST", sglang.UPDATE_ROUTE), ("POST", sglang.CONTINUE_ROUTE),
            ("GET", sglang.MODEL_INFO_ROUTE), ("GET", sglang.LOADS_ROUTE), ("POST", sglang.CHECKSUM_ROUTE)}
    assert used <= declared, f"missing in sglang {SGLANG_VERSION}: {sorted(used - declared)}"


def test_model_info_reports_weight_version_and_loads_report_request_counts() -> None:
    tree = _source("http_server.py.txt")
    func = next(n for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef) and n.name == "model_info")
    keys = {k.value for n in ast.walk(func) if isinstance(n, ast.Dict) for k in n.keys if isinstance(k, ast.Constant)}
    assert "weight_version" in keys
    snapshot = declared_fields(_source("load_snapshot.py.txt"), "LoadSnapshot")
    assert {"num_running_reqs", "num_waiting_reqs"} <= set(snapshot)


def _auth_levels(tree: ast.Module) -> dict[str, str]:
    """route -> the AuthLevel name of its @auth_level decorator ("NORMAL" when it has none)."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        paths = [d.args[0].value for d in node.decorator_list if isinstance(d, ast.Call) and d.args
                 and isinstance(d.args[0], ast.Constant) and isinstance(d.args[0].value, str)]
        levels = [d.args[0].attr for d in node.decorator_list if isinstance(d, ast.Call) and isinstance(d.func, ast.Name)
                  and d.func.id == "auth_level" and isinstance(d.args[0], ast.Attribute)]
        for path in paths:
            out[path] = levels[0] if levels else "NORMAL"
    return out


def test_admin_key_goes_exactly_where_sglang_guards_with_it() -> None:
    levels = _auth_levels(_source("http_server.py.txt")) | _auth_levels(_source("v1_loads.py.txt"))
    for route in sglang.ADMIN_ROUTES:
        assert levels[route] == "ADMIN_OPTIONAL", route
    for route in (sglang.MODEL_INFO_ROUTE, sglang.LOADS_ROUTE):
        assert levels[route] == "NORMAL", route


def test_checksum_action_exists_in_the_weight_checker() -> None:
    tree = _source("weight_checker.py")
    handle = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "handle")
    actions = {c.comparators[0].value for c in ast.walk(handle) if isinstance(c, ast.Compare)
               and isinstance(c.comparators[0], ast.Constant)}
    assert sglang.checksum_body()["action"] in actions
