"""The order the suite's modules are handed out in (tests/ordering.py): the file of their times
names only modules that exist, and the sort puts the longest first, known or guessed."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests import ordering

REPO = ordering.DURATIONS.parents[1]


def test_every_module_the_durations_name_exists_and_every_time_is_a_number() -> None:
    durations = json.loads(ordering.DURATIONS.read_text())
    gone = [name for name in durations if not (REPO / name).is_file()]
    assert not gone, f"tests/durations.json names modules that are gone: {gone}"
    assert all(isinstance(v, int | float) and v >= 0 for v in durations.values())
    assert all(name.startswith("tests/") and name.endswith(".py") for name in durations)


@dataclass
class Item:
    """What the sort reads of a pytest item: its id and its marks."""

    nodeid: str
    marks: dict[str, Any] = field(default_factory=dict)

    def get_closest_marker(self, name: str) -> Any:
        return self.marks.get(name)


def test_modules_go_longest_first_each_in_its_own_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        ordering, "known", lambda: {"tests/a.py": 5.0, "tests/b.py": 50.0, "tests/c.py": 1.0}
    )
    slow = pytest.mark.slow.mark
    long = pytest.mark.timeout(600).mark
    items = [
        Item("tests/a.py::one"),
        Item("tests/c.py::one"),
        Item("tests/new_quick.py::one"),
        Item("tests/a.py::two"),
        Item("tests/new_slow.py::one", {"slow": slow}),
        Item("tests/b.py::one"),
        Item("tests/new_long.py::one", {"timeout": long}),
        Item("tests/b.py::two"),
    ]
    ordering.order(items, 120.0)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == [
        "tests/new_long.py::one",  # unknown, declares a timeout over the suite's: 60 s assumed
        "tests/b.py::one",
        "tests/b.py::two",
        "tests/new_slow.py::one",  # unknown, slow: 10 s assumed
        "tests/a.py::one",
        "tests/a.py::two",
        "tests/c.py::one",
        "tests/new_quick.py::one",
    ]
