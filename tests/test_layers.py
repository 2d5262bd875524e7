"""The project's own imports, read from its source (ast): no cycles between modules, even counting
`if TYPE_CHECKING:` blocks, and no layer imports a higher one (function-level imports included;
type-checking blocks never run and are left out of the layer rules).

Layers, lowest first: live (publish helpers, the live consumer, the one database bridge: it
imports nothing of the project), accounts (users, keys, every way in, the error shape: it imports
only live), history (the fleet's samples and the SVG charts: it imports only live), hardware, hub, serving, and xgenconsole (wiring only: settings, urls, asgi, the API,
serve).
Inside serving, the planes (issue 24 #2): adapters (pure: import nothing of the project), the
models (the state table), control (the load plan and the commands), proxy (the data plane), node
(the agent), web (pages, APIs, dashboard), and the wiring (apps, urls, routing, management
commands). Proxy and node never import web (nor does control); proxy never calls control's
commands (serving.control.services): a cold start is a desired-state write (the instance's own
method) and a nudge, as the rest of the agent's work is. Every module of serving is in a plane.
"""
from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("accounts", "live", "history", "hardware", "hub", "serving", "xgenconsole")
RANK = {"live": 0, "accounts": 1, "history": 1.5, "hardware": 2, "hub": 3, "serving": 4, "xgenconsole": 5}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        root = REPO / package
        if not root.is_dir():
            continue
        for path in root.rglob("*.py"):
            if "migrations" not in path.parts:
                modules[_module_name(path)] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, module: str, known: set[str], *, type_checking: bool = False) -> set[str]:
    """Project modules `module` imports anywhere in its file (`type_checking`: in `if TYPE_CHECKING:`
    blocks too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def resolve(name: str) -> str | None:
        # The longest known module that `name` starts with (a.b.c imports a.b when c is a name in it).
        while name:
            if name in known:
                return name
            name = name.rpartition(".")[0]
        return None

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child) and not type_checking:
                for stmt in child.orelse:
                    visit(stmt)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if (target := resolve(alias.name)) is not None:
                        found.add(target)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in child.names:
                    target = resolve(f"{base}.{alias.name}") or resolve(base)
                    if target is not None:
                        found.add(target)
            visit(child)

    visit(tree)
    found.discard(module)
    return found


def _graph(*, type_checking: bool = False) -> dict[str, set[str]]:
    modules = _project_modules()
    known = set(modules)
    return {name: _imports(path, name, known, type_checking=type_checking) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_module_imports_itself_round_a_cycle():
    cycles = _cycles(_graph(type_checking=True))  # a cycle through type hints is a cycle of the design too
    assert cycles == [], "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_layer_imports_a_higher_one():
    upward = []
    for module, targets in sorted(_graph().items()):
        here = RANK[module.split(".")[0]]
        for target in sorted(targets):
            if RANK[target.split(".")[0]] > here:
                upward.append(f"{module} -> {target}")
    assert upward == [], "upward imports:\n" + "\n".join(upward)


def test_the_floor_imports_no_app_and_adapters_nothing_above_them():
    graph = _graph()
    wrong = []
    for module, targets in sorted(graph.items()):
        top = module.split(".")[0]
        for target in targets:
            allowed = {"live": {"live"}, "accounts": {"accounts", "live"}}.get(top)
            if allowed is not None and target.split(".")[0] not in allowed:
                wrong.append(f"{module} -> {target}")
            if module.startswith("serving.adapters") and not target.startswith("serving.adapters"):
                wrong.append(f"{module} -> {target}")  # pure: spec in, argv out
    assert wrong == [], "\n".join(sorted(wrong))


# serving's planes, by module prefix (the longest that matches wins).
PLANES = {
    "serving.adapters": "adapters",
    "serving.models": "models",
    "serving.control": "control",
    "serving.proxy": "proxy",
    "serving.node": "node",
    "serving.web": "web",
    "serving.apps": "wiring",
    "serving.urls": "wiring",
    "serving.routing": "wiring",
    "serving.management": "wiring",
    "serving": "wiring",  # the package itself (empty)
}
# What each plane may import of serving (the wiring may import any of it).
MAY_IMPORT = {
    "adapters": {"adapters"},
    "models": {"models"},
    "control": {"adapters", "models", "control"},
    "proxy": {"adapters", "models", "control", "proxy"},
    "node": {"adapters", "models", "control", "node"},  # and the proxy's usage recording: NODE_MAY_CALL
    "web": {"adapters", "models", "control", "proxy", "node", "web"},
}
COMMANDS = "serving.control.services"  # the commands the web side and the API issue
# The node's agent replays the usage journals web processes left and prunes the request log's
# segments: the one part of the data plane it calls.
NODE_MAY_CALL = {"serving.proxy.usage"}


def plane(module: str) -> str | None:
    if module != "serving" and not module.startswith("serving."):
        return None
    while module not in PLANES:
        module = module.rpartition(".")[0]
    return PLANES[module]


def _plane_violations(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, targets in sorted(graph.items()):
        here = plane(module)
        if here is None:
            continue
        if here == "wiring" and module.count(".") == 1 and module not in PLANES:
            wrong.append(f"{module}: a flat module of serving; put it in a plane (control, proxy, node, web, adapters)")
        for target in sorted(targets):
            there = plane(target)
            if there is None or here == "wiring":
                continue
            if here == "node" and target in NODE_MAY_CALL:
                continue
            if there not in MAY_IMPORT[here]:
                wrong.append(f"{module} -> {target}: {here} may not import {there}")
            elif here == "proxy" and (target == COMMANDS or target.startswith(COMMANDS + ".")):
                wrong.append(f"{module} -> {target}: the proxy calls no command of control "
                             "(write the desired state, or send a message)")
    return wrong


def test_serving_planes_import_only_what_they_may():
    wrong = _plane_violations(_graph())
    assert wrong == [], "\n".join(wrong)


def test_the_plane_rules_catch_a_wrong_import():
    # The rules themselves, on made-up edges: each of these is refused, the allowed ones pass.
    graph = {
        "serving.proxy.relay": {"serving.web.views"},
        "serving.node.agent": {"serving.web.dashboard"},
        "serving.proxy.ondemand": {"serving.control.services"},
        "serving.adapters.vllm": {"serving.models"},
        "serving.control.planning": {"serving.proxy.app"},
        "serving.helpers": set(),
        "serving.web.views": {"serving.control.services", "serving.proxy.metrics"},
        "serving.node.supervisor": {"serving.control.services", "serving.models"},
        "serving.urls": {"serving.web.views"},
    }
    wrong = _plane_violations(graph)
    assert [w.split(":")[0] for w in wrong] == [
        "serving.adapters.vllm -> serving.models", "serving.control.planning -> serving.proxy.app", "serving.helpers",
        "serving.node.agent -> serving.web.dashboard", "serving.proxy.ondemand -> serving.control.services",
        "serving.proxy.relay -> serving.web.views"], wrong


def test_the_walker_sees_what_it_must():
    # The checks above are only as good as the graph: it must hold known edges of every kind.
    graph = _graph()
    assert "serving.proxy.replicas" in graph["serving.proxy.routing"]  # a top-level from-import
    assert "serving.node.agent" not in graph["serving.node.supervisor"]  # no longer even for type checking
    assert "serving.control.starts" in graph["serving.proxy.ondemand"]  # a function-level import
    assert "serving.node.supervisor" in graph["serving.node.agent"]
    fake = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": set()}
    assert _cycles(fake) == [["a.x", "a.y", "a.z"]]
