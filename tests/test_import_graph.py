"""No import cycle among epochal's modules, read from the source (no module is imported).

Every ``import`` counts, also one inside a function (a lazy import that closes a cycle only
hides it until the call), except those under ``if TYPE_CHECKING:``. ``from package import name``
is an edge to ``package.name`` when that is a module, else to ``package``; a package's implicit
import of its parents is not an edge, so a package ``__init__`` may re-export its submodules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import epochal

ROOT = Path(epochal.__file__).parent


def module_names(root: Path) -> dict[str, Path]:
    """Every module under ``root`` (a package directory) by dotted name."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            visit(child)

    visit(tree)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each module's edges to the other modules of the package at ``root``."""
    modules = module_names(root)

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [known(alias.name) for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else known(base)
                    for a in node.names
                ]
            edges.update(t for t in targets if t is not None and t != name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_path_through(graph, set(g), min(g)) for g in groups]


def _path_through(graph: dict[str, set[str]], group: set[str], start: str) -> list[str]:
    """A shortest import path from ``start`` back to itself inside ``group``."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is in a cycle but no path leads back to it")


def test_epochal_has_no_import_cycle():
    graph = import_graph(ROOT)
    assert "epochal.worker.strategies.registry" in graph  # the walk sees the packages
    found = cycles(graph)
    assert not found, "import cycles (break each, e.g. by moving the shared part out):\n" + (
        "\n".join(" -> ".join(c) for c in found)
    )


def test_a_cycle_closed_by_a_lazy_import_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.b import B\n")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from pkg.c import C\n"
        "def f():\n    from pkg.sub import b\n    return b\n"
    )
    (pkg / "sub" / "b.py").write_text("from .. import a\nclass B: ...\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b"}  # the TYPE_CHECKING import is no edge
    assert graph["pkg.sub.b"] == {"pkg.a"}  # relative "from .. import a" resolved
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.a"]]
