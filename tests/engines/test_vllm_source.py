"""Every route, parameter, worker method and metric the vLLM adapter uses exists in the pinned vLLM release.

Read from vLLM 0.33.0's own source text (tests/engines/data/vllm-0.33.0/, parsed with ast, never
imported as vllm; tests/engines/fetch_vllm_sources.py re-extracts or checks it). FastAPI would answer
a wrong route with 404 and a wrong JSON key of /collective_rpc's kwargs with a worker TypeError, but
a query parameter sent as a body field, or the reverse, would be silently ignored: those are pinned here.
"""

from __future__ import annotations

import ast

import pytest
from vllm_standin import pause_modes, read_source

from deltafs.engines import vllm
from deltafs.engines.base import Target

TARGET = Target(path="/models/current.deltafs/v0000000042-abcd", version="42")


def functions(tree: ast.Module) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def routes(tree: ast.Module) -> dict[tuple[str, str], ast.FunctionDef | ast.AsyncFunctionDef]:
    """(method, path) -> handler, for every @router.get/@router.post decorator."""
    out = {}
    for func in functions(tree).values():
        for dec in func.decorator_list:
            if (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.func.attr in ("get", "post")
                    and dec.args and isinstance(dec.args[0], ast.Constant)):
                out[(dec.func.attr.upper(), dec.args[0].value)] = func
    return out


def all_routes() -> dict[tuple[str, str], ast.FunctionDef | ast.AsyncFunctionDef]:
    return {**routes(read_source("rl_online_api_router.py.txt")), **routes(read_source("dev_rpc_api_router.py.txt"))}


def param_kinds(func: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, str]:
    """Parameter -> "Query" or "Body" (from Annotated[..., Query()/Body(...)]), or "" when neither."""
    out = {}
    for arg in func.args.args:
        kind = ""
        ann = arg.annotation
        if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Annotated":
            for meta in ann.slice.elts[1:]:  # type: ignore[attr-defined]
                if isinstance(meta, ast.Call) and isinstance(meta.func, ast.Name):
                    kind = meta.func.id
        out[arg.arg] = kind
    return out


def body_keys_read(func: ast.AST) -> set[str]:
    """Keys a handler reads from its parsed JSON body: body.get("k") and body["k"]."""
    keys = set()
    for node in ast.walk(func):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "body"
                and node.args and isinstance(node.args[0], ast.Constant)):
            keys.add(node.args[0].value)
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "body" \
                and isinstance(node.slice, ast.Constant):
            keys.add(node.slice.value)
    return keys


def test_every_route_the_adapter_calls_exists() -> None:
    used = {("POST", vllm.PAUSE_ROUTE), ("POST", vllm.RESUME_ROUTE), ("POST", vllm.RPC_ROUTE),
            ("POST", vllm.SET_VERSION_ROUTE), ("GET", vllm.VERSION_ROUTE), ("POST", vllm.CHECKER_ROUTE)}
    assert set(vllm.DEV_ROUTES) == {path for _, path in used}
    declared = set(all_routes())
    assert used <= declared, f"missing in vllm 0.33.0: {sorted(used - declared)}"


def test_pause_parameters_are_query_parameters_with_vllms_modes() -> None:
    handler = all_routes()[("POST", vllm.PAUSE_ROUTE)]
    kinds = param_kinds(handler)
    for name in vllm.pause_params("keep"):
        assert kinds.get(name) == "Query", f"/pause takes {name!r} as {kinds.get(name) or 'nothing'}, not a query"
    assert set(vllm.PAUSE_MODES) == set(pause_modes())
    assert set(vllm.PAUSE_ALIASES.values()) <= set(pause_modes())


def test_weight_version_is_set_by_a_json_field_and_read_back() -> None:
    found = all_routes()
    kinds = param_kinds(found[("POST", vllm.SET_VERSION_ROUTE)])
    for name in vllm.version_body("42"):
        assert kinds.get(name) == "Body", f"/update_weight_version has no body field {name!r}: {kinds}"
    reader = found[("GET", vllm.VERSION_ROUTE)]
    keys = {k.value for n in ast.walk(reader) if isinstance(n, ast.Dict) for k in n.keys if isinstance(k, ast.Constant)}
    assert "weight_version" in keys


def test_weight_checker_fields_and_answers() -> None:
    handler = all_routes()[("POST", vllm.CHECKER_ROUTE)]
    kinds = param_kinds(handler)
    for body in (vllm.checksum_body(), vllm.compare_body({"dp0:pp0:pcp0:tp0:w": "00"})):
        assert all(kinds.get(name) == "Body" for name in body), (body, kinds)
    action = next(a.annotation for a in handler.args.args if a.arg == "action")
    literal = ast.unparse(action.slice.elts[0])  # type: ignore[attr-defined]
    assert "'checksum'" in literal and "'compare'" in literal
    keys = {k.value for n in ast.walk(handler) if isinstance(n, ast.Dict) for k in n.keys if isinstance(k, ast.Constant)}
    assert {"checksums", "match", "mismatches"} <= keys


def test_collective_rpc_body_names_a_worker_method_with_those_keyword_arguments() -> None:
    handler = all_routes()[("POST", vllm.RPC_ROUTE)]
    body = vllm.reload_body(TARGET)
    assert set(body) <= body_keys_read(handler)
    # The route passes only strings ("for security reason"): no bool or number may be sent.
    assert all(isinstance(v, str) for v in body["kwargs"].values())
    assert body["method"] in functions(read_source("gpu_worker.py.txt"))
    for name in ("gpu_model_runner.py.txt", "gpu_v2_model_runner.py.txt"):
        runner = functions(read_source(name))[vllm.RELOAD_METHOD]
        params = {a.arg for a in runner.args.args}
        assert set(body["kwargs"]) <= params, f"{name}: reload_weights has no {sorted(set(body['kwargs']) - params)}"


def test_the_keyword_check_catches_a_misspelling() -> None:
    runner = functions(read_source("gpu_model_runner.py.txt"))["reload_weights"]
    params = {a.arg for a in runner.args.args}
    assert "weights_path" in params and "weight_path" not in params and "model_path" not in params


def test_reload_reads_the_whole_directory_with_the_servers_loader() -> None:
    # What the docs promise: weights_path replaces the model path, and the normal loader reads it.
    source = ast.unparse(functions(read_source("reload_inplace.py.txt"))["reload_weights"])
    assert "model_config.model = weights_path" in source
    assert "model_loader.get_all_weights(model_config, model)" in source


def test_busy_metrics_are_vllms_scheduler_gauges() -> None:
    tree = read_source("metrics_loggers.py.txt")
    names = {kw.value.value for n in ast.walk(tree) if isinstance(n, ast.Call) for kw in n.keywords
             if kw.arg == "name" and isinstance(kw.value, ast.Constant)}
    assert set(vllm.BUSY_METRICS) <= names


def _if_blocks_calling(tree: ast.Module, callee: str) -> list[str]:
    """The test expression of every `if` whose body calls callee."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            for inner in node.body:
                for call in ast.walk(inner):
                    if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == callee:
                        out.append(ast.unparse(node.test))
    return out


@pytest.mark.parametrize("register", ["register_rl_api_routers", "register_vllm_dev_api_routers"])
def test_the_routes_exist_only_in_dev_mode(register: str) -> None:
    assert _if_blocks_calling(read_source("launchers_routers.py.txt"), register) == ["envs.VLLM_SERVER_DEV_MODE"]


def test_dev_routers_include_collective_rpc() -> None:
    dev = functions(read_source("serve_init.py.txt"))["register_vllm_dev_api_routers"]
    modules = {n.module for n in ast.walk(dev) if isinstance(n, ast.ImportFrom)}
    assert "dev.rpc.api_router" in modules


def test_vllms_api_key_does_not_guard_the_routes_deltafs_uses() -> None:
    tree = read_source("middleware_authenticate.py.txt")
    assign = next(n for n in tree.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "GUARDED_PREFIX")
    guarded = tuple(ast.literal_eval(assign.value))
    for route in (*vllm.DEV_ROUTES, vllm.METRICS_ROUTE):
        assert not route.startswith(guarded), route
