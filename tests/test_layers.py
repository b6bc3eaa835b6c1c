"""The package's layers hold: the I/O-free core depends on nothing above it, and no
module imports itself back through another (import cycles make the data path unreadable).

Imports are read from the source with `ast`, lazy ones inside functions included.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.paths import ROOT

PACKAGE = ROOT / "proxy"

#: Which top-level parts of `proxy` each layer may import. Anything not listed is refused.
ALLOWED: dict[str, frozenset[str]] = {
    "core": frozenset({"core", "types"}),
    "sinks": frozenset({"core", "sinks", "types", "settings"}),
    "sim": frozenset({"core", "sim", "types"}),
    "bench": frozenset({"core", "bench", "sim", "types", "openfiles"}),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            # `from proxy.core import errors` names a module too
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "proxy" or name.startswith("proxy.")}


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        # Importing proxy.a.b imports the package proxy.a first: that edge is implicit.
        graph[name] = {
            m for m in _imports(path) if m in modules and m != name and not name.startswith(m + ".")
        }
    return graph


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_each_layer_imports_only_the_layers_below_it() -> None:
    wrong = []
    for module, deps in _graph().items():
        allowed = ALLOWED.get(_layer(module))
        if allowed is None:
            continue
        wrong.extend(f"{module} -> {dep}" for dep in deps if _layer(dep) not in allowed)
    assert wrong == []


def test_there_are_no_import_cycles() -> None:
    graph = _graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append([*path[path.index(dep) :], dep])
            elif dep not in state:
                visit(dep)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert cycles == []


def test_the_graph_sees_the_packages_own_imports() -> None:
    """Guard the guard: if parsing broke, the tests above would pass on an empty graph."""
    graph = _graph()
    assert "proxy.core.measurement" in graph["proxy.core.observe"]
    assert any(dep.startswith("proxy.core") for dep in graph["proxy.server.forward"])
