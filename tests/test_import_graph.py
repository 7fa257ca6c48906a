"""The import rules docs/architecture.md states, and no import cycle, read from the source (no
module is imported).

The rules are read from the table in docs/architecture.md (between its ``import-rules`` markers),
and the decision modules from its ``decision-modules`` list, so the document and this test cannot
disagree. Every ``import`` counts, also one inside a function (a lazy import that closes a
cycle only hides it until the call), except those under ``if TYPE_CHECKING:``. ``from package
import name`` is an edge to ``package.name`` when that is a module, else to ``package``; a
package's implicit import of its parents is not an edge, so a package ``__init__`` may re-export
its submodules.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

import epochal

ROOT = Path(epochal.__file__).parent
ARCHITECTURE = ROOT.parent / "docs" / "architecture.md"

PARTS = ("protocol", "coordinator", "worker", "observe", "launch", "security")
"""The subpackages that are parts of their own; cli/parser.py is "cli", __init__ "api", the rest
"shared"."""

LIBRARIES = (
    "torch",
    "numpy",
    "zmq",
    "msgpack",
    "matplotlib",
    "tensorboard",
    "prometheus_client",
    "tqdm",
)
"""The third-party libraries the rules name: importing one is allowed only where the table says."""

CLOCK_SOCKET_FILE = {
    "asyncio",
    "zmq",
    "time",
    "socket",
    "os",
    "shutil",
    "pathlib",
    "subprocess",
    "threading",
    "select",
    "selectors",
}
"""What a decision module may not import: a clock, a socket, a file, a thread."""


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


@functools.cache
def parsed(path: Path) -> ast.Module:
    """``path``'s syntax tree, parsed once a session: every test reads the same files (the trees
    are only read)."""
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


@functools.cache
def imports_in(path: Path) -> tuple[ast.Import | ast.ImportFrom, ...]:
    """The imports of the module at ``path`` that count (see :func:`_imports`)."""
    return tuple(_imports(parsed(path)))


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
        for node in imports_in(path):
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
    assert "epochal.worker.strategies.modes" in graph  # the walk sees the packages
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


# ----------------------------------------------------------------------------- the stated rules


def part_of(module: str) -> str:
    """The part ``module`` (a dotted name under ``epochal``) belongs to in the rules table."""
    parts = module.split(".")
    if len(parts) == 1:
        return "api"
    if parts[1] in PARTS:
        return parts[1]
    if parts[1] == "__main__" or parts[1:3] == ["cli", "parser"]:
        return "cli"
    return "shared"


def _between(text: str, marker: str) -> str:
    start = text.index(f"<!-- {marker}:")
    end = text.index(f"<!-- end {marker} -->", start)
    return text[text.index("-->", start) + 3 : end]


def stated_rules(text: str) -> dict[str, set[str]]:
    """Each part's allowed imports, from the table between the ``import-rules`` markers."""
    rules: dict[str, set[str]] = {}
    for line in _between(text, "import-rules").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or cells[0] in ("part", "") or set(cells[0]) <= {"-"}:
            continue
        rules[cells[0]] = {c.strip() for c in cells[1].split(",") if c.strip()}
    return rules


RULES = ROOT / "coordinator" / "rules"
"""The coordinator's decisions: every module under this folder is pure (docs/architecture.md)."""


def decision_modules(folder: Path = RULES) -> list[str]:
    """Every module under ``folder``, as dotted names: the folder is the list."""
    return sorted(name for name, path in module_names(ROOT).items() if path.parent == folder)


def libraries_imported(path: Path) -> set[str]:
    """The top-level names of the absolute imports in ``path`` (lazy ones included)."""
    names = set()
    for node in imports_in(path):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def broken_rules(root: Path, rules: dict[str, set[str]]) -> list[str]:
    """Every import of the package at ``root`` the rules do not allow, as "a -> b" lines."""
    broken = []
    paths = module_names(root)
    for module, targets in sorted(import_graph(root).items()):
        mine = part_of(module)
        allowed = rules[mine] | {mine}
        for target in sorted(targets):
            if part_of(target) not in allowed:
                broken.append(f"{module} -> {target} ({mine} may not import {part_of(target)})")
        for library in sorted(libraries_imported(paths[module]) & set(LIBRARIES)):
            if library not in allowed:
                broken.append(f"{module} -> {library} ({mine} may not import {library})")
    return broken


def test_the_architecture_document_states_a_rule_for_every_part():
    rules = stated_rules(ARCHITECTURE.read_text(encoding="utf-8"))
    assert set(rules) == {*PARTS, "shared", "cli", "api"}
    named = set().union(*rules.values())
    assert named <= {*rules, *LIBRARIES}, (
        f"unknown names in the table: {named - {*rules, *LIBRARIES}}"
    )


def test_every_import_follows_the_rules_the_architecture_document_states():
    rules = stated_rules(ARCHITECTURE.read_text(encoding="utf-8"))
    broken = broken_rules(ROOT, rules)
    assert not broken, "imports docs/architecture.md does not allow:\n" + "\n".join(broken)


def test_a_broken_rule_is_found_also_in_a_lazy_import(tmp_path):
    pkg = tmp_path / "epochal"
    for part in ("coordinator", "worker"):
        (pkg / part).mkdir(parents=True)
        (pkg / part / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "coordinator" / "service.py").write_text(
        "from epochal.errors import x\ndef f():\n    import torch\n"
        "    from epochal.worker import session\n"
    )
    (pkg / "worker" / "session.py").write_text("import torch\n")
    rules = {"coordinator": {"shared"}, "worker": {"shared", "torch"}, "shared": set()}
    rules.update({p: set() for p in (*PARTS, "cli", "api") if p not in rules})
    assert broken_rules(pkg, rules) == [
        "epochal.coordinator.service -> epochal.worker.session (coordinator may not import worker)",
        "epochal.coordinator.service -> torch (coordinator may not import torch)",
    ]


def test_the_parts_import_each_other_without_a_cycle():
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph(ROOT).items():
        graph.setdefault(part_of(module), set()).update(
            part_of(t) for t in targets if part_of(t) != part_of(module)
        )
    assert not cycles(graph), f"a cycle between parts: {cycles(graph)}"


def opens(path: Path) -> list[int]:
    """The lines of ``path`` that call ``open``."""
    return [
        node.lineno
        for node in ast.walk(parsed(path))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open"
    ]


def reached(graph: dict[str, set[str]], module: str) -> dict[str, list[str]]:
    """Every module ``module`` imports, directly or through others, with one import path to it."""
    paths = {module: [module]}
    frontier = [module]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    del paths[module]
    return paths


@pytest.mark.parametrize("module", decision_modules())
def test_the_decision_modules_read_no_clock_and_touch_no_socket_or_file(module: str):
    path = module_names(ROOT)[module]
    imported = libraries_imported(path)
    assert not imported & CLOCK_SOCKET_FILE, f"{module} imports {imported & CLOCK_SOCKET_FILE}"
    assert not opens(path), f"{module} opens a file at line(s) {opens(path)}"


@pytest.mark.parametrize("module", decision_modules())
def test_what_a_decision_module_imports_reads_no_clock_and_touches_no_socket_or_file(module: str):
    """Also through the modules it imports: each of those may hold a path as a value (pathlib),
    nothing more of CLOCK_SOCKET_FILE, and opens no file."""
    names = module_names(ROOT)
    impure = []
    for other, route in reached(import_graph(ROOT), module).items():
        found = libraries_imported(names[other]) & (CLOCK_SOCKET_FILE - {"pathlib"})
        if found or opens(names[other]):
            why = f"imports {sorted(found)}" if found else f"opens a file at {opens(names[other])}"
            impure.append(f"{' -> '.join(route)}: {other} {why}")
    assert not impure, "\n".join(impure)


def test_an_impure_module_reached_through_another_is_found(tmp_path, monkeypatch):
    pkg = tmp_path / "epochal"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "pure.py").write_text("from epochal import middle\n")
    (pkg / "middle.py").write_text("from pathlib import Path\nfrom epochal import disk\n")
    (pkg / "disk.py").write_text("def read(p):\n    return open(p).read()\n")
    graph = import_graph(pkg)
    assert reached(graph, "epochal.pure") == {
        "epochal.middle": ["epochal.pure", "epochal.middle"],
        "epochal.disk": ["epochal.pure", "epochal.middle", "epochal.disk"],
    }
    assert opens(pkg / "disk.py") == [2] and not opens(pkg / "middle.py")


def test_the_decision_modules_are_the_rules_folder():
    modules = decision_modules()
    assert {"epochal.coordinator.rules.machine", "epochal.coordinator.rules.batches"} <= set(
        modules
    )
    assert not any(m.startswith("epochal.coordinator.serve.") for m in modules)
    assert "decision-modules" not in ARCHITECTURE.read_text(encoding="utf-8"), (
        "the folder is the list: docs/architecture.md names the rule, not the modules"
    )
