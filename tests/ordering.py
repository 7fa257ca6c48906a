"""The order in which pytest-xdist hands the modules out: the longest first, the quick ones last.

``--dist loadgroup`` hands the tests out in the order collected (a group of tests as one unit,
the groups with the most tests first), one to whichever test process has run out of work. The
suite runs more test processes than CPUs, because many tests mostly wait on timeouts they
configure (a heartbeat, a stall, a lost worker); such waits cost nothing while other tests keep
the CPUs busy, but at the end of the run, with nothing left to overlap them, the CPUs stand idle
while the last waits run out. So the modules are ordered by the time they took in a whole run
(:data:`DURATIONS`, their tests' setup, call and teardown summed), longest first, and the many
quick unit tests fill the end. A module the file does not know yet is placed by its own marks:
one whose pytest-timeout is above the suite's (a long test by its own word) before the modules
with a ``slow`` test, those before the rest. Each module keeps its own order (its module-scoped
fixtures set up once, the parameters of one in turn).

``python -m pytest --write-durations`` writes the file anew from the run it ends (the modules it
ran; the others keep their entries); ``tests/test_ordering.py`` fails on an entry naming a module
that no longer exists.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

DURATIONS = Path(__file__).resolve().parent / "durations.json"
"""Seconds each test module took in a whole run, by path from the repository root."""

UNKNOWN_DECLARED = 60.0
UNKNOWN_SLOW = 10.0
"""The seconds assumed of a module missing from :data:`DURATIONS`: one declaring a timeout over
the suite's, one holding a ``slow`` test (every other one: none)."""


def known() -> dict[str, float]:
    """:data:`DURATIONS`, or nothing where it is missing."""
    try:
        durations: dict[str, float] = json.loads(DURATIONS.read_text())
    except FileNotFoundError:
        return {}
    return durations


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def order(items: list[pytest.Item], default_timeout: float) -> None:
    """Sort ``items`` in place: their modules longest first, each module in its own order."""
    durations = known()
    guessed: dict[str, float] = {}
    for item in items:
        name = module_of(item.nodeid)
        if name in durations:
            continue
        mark = item.get_closest_marker("timeout")
        if mark is not None and mark.args and float(mark.args[0]) > default_timeout:
            guessed[name] = max(guessed.get(name, 0.0), UNKNOWN_DECLARED)
        elif item.get_closest_marker("slow") is not None:
            guessed[name] = max(guessed.get(name, 0.0), UNKNOWN_SLOW)
    seconds = {**guessed, **durations}
    # stable: the order within a module, and among modules of the same time, is kept
    items.sort(key=lambda item: -seconds.get(module_of(item.nodeid), 0.0))


class Recorder:
    """Sums the controller's reports by module and writes :data:`DURATIONS` at the end."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[module_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: Any) -> None:
        if not self.seconds:  # registered on the controller only (tests/conftest.py)
            return
        merged = {**known(), **{k: round(v, 1) for k, v in self.seconds.items()}}
        ordered = dict(sorted(merged.items(), key=lambda kv: (-kv[1], kv[0])))
        DURATIONS.write_text(json.dumps(ordered, indent=1) + "\n")
