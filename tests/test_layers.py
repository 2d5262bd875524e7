"""The project's own imports, read from its source (ast): no cycles between modules, and no layer
imports a higher one (function-level imports included; `if TYPE_CHECKING:` blocks never run and
are left out).

Layers, lowest first: live (publish helpers, the live consumer, the one database bridge: it
imports nothing of the project), accounts (users, keys, every way in, the error shape: it imports
only live), history (the fleet's samples and the SVG charts: it imports only live), hardware, hub, serving, and xgenconsole (wiring only: settings, urls, asgi, the API,
serve).
Inside serving, adapters import nothing of serving above them.
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


def _imports(path: Path, module: str, known: set[str]) -> set[str]:
    """Project modules `module` imports anywhere in its file."""
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
            if isinstance(child, ast.If) and _is_type_checking(child):
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


def _graph() -> dict[str, set[str]]:
    modules = _project_modules()
    known = set(modules)
    return {name: _imports(path, name, known) for name, path in modules.items()}


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
    cycles = _cycles(_graph())
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
                if target.startswith("serving."):
                    wrong.append(f"{module} -> {target}")
    assert wrong == [], "\n".join(sorted(wrong))


def test_the_walker_sees_what_it_must():
    # The checks above are only as good as the graph: it must hold known edges of every kind.
    graph = _graph()
    assert "serving.proxy.replicas" in graph["serving.proxy.app"]  # a top-level from-import
    assert "serving.node.supervisor" in graph["serving.node.agent"]
    fake = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": set()}
    assert _cycles(fake) == [["a.x", "a.y", "a.z"]]
