"""The worker's Session is composed, not inherited: it holds its parts and calls them, and no part
calls another (docs/architecture.md, "a concern of the worker's session")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from epochal.errors import CoordinatorLost, RunAborted
from epochal.worker import sessionparts
from epochal.worker.session import Session
from epochal.worker.sessionparts.exchange import Exchange

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


class _Silent:
    """A control client whose receive raises ``word`` (or times out when it is None)."""

    abort_grace = 1.0

    def __init__(self, word: BaseException | None) -> None:
        self.word = word
        self.asked = 0

    def receive(self, timeout: float | None = None) -> object:
        self.asked += 1
        raise self.word if self.word is not None else TimeoutError("nothing")


LOST = RuntimeError(
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer"
)


@pytest.mark.parametrize(
    "word",
    [RunAborted("rank 1 failed: ValueError: bad"), CoordinatorLost("sent nothing for 3 s")],
)
def test_a_lost_peer_is_told_by_the_coordinators_word_on_its_cause(
    word: RunAborted, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rank whose collective broke because a peer left says why the peer left: the abort
    naming the first failure, or the coordinator's silence that every rank noticed; the error
    itself stays in its output, in one line, for a reason that points to it."""
    client = _Silent(word)
    exchange = Exchange(client, None)  # type: ignore[arg-type]
    assert exchange.word_on(LOST) is word
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and said[0].startswith("epochal: RuntimeError: ["), said
    assert "Connection closed by peer" in said[0]
    assert "this rank lost a peer of the data plane" in said[0]


def test_an_error_of_its_own_or_no_word_in_time_is_said_as_it_is() -> None:
    client = _Silent(RunAborted("never asked"))
    assert Exchange(client, None).word_on(ValueError("the user's own")) is None  # type: ignore[arg-type]
    assert client.asked == 0  # its own error: nothing waited for
    client = _Silent(None)
    assert Exchange(client, None).word_on(LOST) is None  # type: ignore[arg-type]
    assert client.asked == 1
