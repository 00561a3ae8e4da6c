"""The project's import graph, read from the source with ``ast`` (nothing is imported).

Every ``import`` and ``from ... import`` counts, at module level and inside functions alike; only
edges between the project's own modules are kept (torch, plotly, ray and dask are outside the
graph, so importing them lazily is never a cycle). Used by ``tests/test_architecture.py``.
"""

import ast
from collections.abc import Iterable
from pathlib import Path

import networkx as nx


def module_name(root: Path, path: Path) -> str:
    """``sim/core/engine.py`` -> ``sim.core.engine``; a package's ``__init__.py`` -> the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Every module of ``packages`` (folders under ``root``), by dotted name."""
    return {module_name(root, p): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}


def _targets(node: ast.AST, here: str, is_package: bool, known: set[str]) -> list[str]:
    """The project modules one import statement names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in known]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative import: resolve against this module's package
        package = here if is_package else here.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    found = []
    for alias in node.names:
        child = f"{base}.{alias.name}"
        if child in known:  # ``from sim.core import engine``: the submodule
            found.append(child)
        elif base in known:  # ``from sim.core.engine import Engine``: the module
            found.append(base)
    return found


def import_graph(root: Path, packages: Iterable[str]) -> "nx.DiGraph[str]":
    """A directed graph with an edge a -> b when module a imports module b."""
    modules = project_modules(root, packages)
    known = set(modules)
    graph: nx.DiGraph[str] = nx.DiGraph()
    graph.add_nodes_from(known)
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            for target in _targets(node, name, is_package, known):
                if target != name:
                    graph.add_edge(name, target)
    return graph


def cycles(graph: "nx.DiGraph[str]") -> list[list[str]]:
    """Every import cycle, each as a sorted list of the modules in one strongly connected component."""
    return sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)


def layer_of(module: str, layers: dict[str, int]) -> int | None:
    """The layer of the longest prefix of ``module`` listed in ``layers``."""
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in layers:
            return layers[prefix]
    return None


def upward_imports(graph: "nx.DiGraph[str]", layers: dict[str, int]) -> list[tuple[str, str]]:
    """Edges a -> b where b sits in a higher layer than a, or in another package of the same
    layer (packages of one layer are independent of each other)."""
    bad = []
    for a, b in graph.edges:
        la, lb = layer_of(a, layers), layer_of(b, layers)
        if la is None or lb is None:
            continue
        if lb > la or (lb == la and _package(a, layers) != _package(b, layers)):
            bad.append((a, b))
    return sorted(bad)


def _package(module: str, layers: dict[str, int]) -> str:
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in layers:
            return prefix
    return module
