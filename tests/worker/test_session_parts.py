"""The worker's Session is composed, not inherited: it holds its parts and calls them, and no part
calls another (docs/architecture.md, "a concern of the worker's session")."""

from __future__ import annotations

import ast
from pathlib import Path

from epochal.worker import sessionparts
from epochal.worker.session import Session

PARTS = Path(sessionparts.__file__).parent
SHARED = {"standing"}  # what the session knows, which every part may read


def _imported_parts(path: Path) -> set[str]:
    """The sessionparts modules ``path`` imports, lazily or not."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        prefix = "epochal.worker.sessionparts."
        found |= {n[len(prefix) :].split(".")[0] for n in names if n.startswith(prefix)}
    return found


def test_no_part_of_the_session_imports_another_but_what_the_session_knows():
    modules = sorted(p for p in PARTS.glob("*.py") if p.name != "__init__.py")
    assert len(modules) >= 5  # the walk found the parts
    reaching = {
        p.stem: sorted(_imported_parts(p) - SHARED - {p.stem})
        for p in modules
        if _imported_parts(p) - SHARED - {p.stem}
    }
    assert reaching == {}, f"parts that call another part, not through the session: {reaching}"


def test_the_session_inherits_nothing_of_its_parts():
    assert Session.__bases__ == (object,)
