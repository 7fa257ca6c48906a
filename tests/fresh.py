"""The suite's fresh starts: processes started as Slurm, Kubernetes, torchrun and ``epochal
worker`` start them, each a new interpreter, rather than forked from the session's preloaded
process (:mod:`tests.forked`).

Most tests fork what they start, which saves most of the suite's CPU but leaves the path every
deployment takes the less tested one. So a chosen set of launch and integration tests runs both
ways, ``[forked]`` and ``[fresh]`` in its ids (``BOTH_STARTS`` in ``tests/integration/conftest.py``;
``tests/test_fresh.py`` fails if the set is empty or misses a way of starting a run), and
``EPOCHAL_TEST_FRESH=1`` runs every test fresh: no preloaded process for the session, every
process of the ``spawn`` fixture started fresh, its ``[forked]`` variants skipped.

A fresh start is checked, not assumed. :func:`environment` is the environment of a fresh start:
no preloaded process named, ``EPOCHAL_PRELOAD=none`` (``epochal run`` starts each worker as a
fresh interpreter rather than forking it from a process of its own), and
``tests/freshsite/sitecustomize.py`` on the path, which notes every interpreter that starts.
:func:`failures` reads those notes after the test: a process is forked only when one that names a
preloaded process or holds a channel to one asks, or by a preloaded process itself, and each of
those would be noted.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from epochal.environment import PRELOAD_ENV, PRELOAD_SOCKET_ENV
from epochal.zygote import CHANNEL_ENV
from epochal.zygote import SCRIPT as ZYGOTE_SCRIPT

FRESH_ENV = "EPOCHAL_TEST_FRESH"
"""``1``: the whole suite starts its processes fresh (``EPOCHAL_TEST_FRESH=1 python -m pytest
tests/integration``)."""

STARTS_ENV = "EPOCHAL_TEST_STARTS"
"""The file every interpreter of a fresh start notes itself in (``tests/freshsite``)."""

SITE = Path(__file__).parent / "freshsite"
"""The directory of the ``sitecustomize`` that notes each interpreter as it starts."""

FORKED, FRESH = "forked", "fresh"
"""How a test's processes start: the two ids of a test run both ways."""


def whole_suite(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``EPOCHAL_TEST_FRESH`` asks for the whole suite to start its processes fresh."""
    return environ.get(FRESH_ENV, "").strip().lower() not in ("", "0", "no", "false")


def environment(env: Mapping[str, str], starts: Path) -> dict[str, str]:
    """``env`` for a fresh start whose interpreters are noted in ``starts``."""
    fresh = {name: value for name, value in env.items() if name != PRELOAD_SOCKET_ENV}
    fresh[PRELOAD_ENV] = "none"
    fresh[STARTS_ENV] = str(starts)
    fresh["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), env.get("PYTHONPATH")]))
    return fresh


def read_starts(path: Path) -> list[dict[str, Any]]:
    """The notes of the interpreters that started (none if the file is not there)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def failures(starts: Sequence[Mapping[str, Any]], started: int) -> list[str]:
    """Why a test that started ``started`` processes fresh, whose interpreters noted ``starts``,
    may have had one forked after all, one line each; empty when none can have been."""
    found = []
    if started and not starts:
        found.append(f"{started} processes started fresh, but no interpreter noted its start")
    for note in starts:
        argv = " ".join(note["argv"])
        for name in (PRELOAD_SOCKET_ENV, CHANNEL_ENV):
            if name in note["env"]:
                found.append(f"pid {note['pid']} ({argv}) had {name}={note['env'][name]}")
        if ZYGOTE_SCRIPT in note["argv"]:
            found.append(f"pid {note['pid']} ({argv}) is a preloaded process that forks")
    return found
