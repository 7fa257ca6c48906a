"""The suite's fresh starts hold (:mod:`tests.fresh`): every way of starting a run has a test
that also runs with its processes started fresh, and a fresh start that forked would be seen.

The set is read from the source (the tests marked ``BOTH_STARTS``), so it cannot be emptied
without this failing; the check that a fresh test's processes were not forked is driven with a
real interpreter start, so a start that stopped noting itself fails here too.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from epochal.environment import PRELOAD_ENV, PRELOAD_SOCKET_ENV
from epochal.zygote import CHANNEL_ENV
from epochal.zygote import SCRIPT as ZYGOTE_SCRIPT
from tests import fresh

INTEGRATION = Path(__file__).parent / "integration"

START_PATHS = {
    "test_elastic.py": "epochal run: the launcher's workers, a store server for each new world",
    "test_launchenv.py": "a coordinator and its workers started apart, as Slurm starts them",
    "test_supervisor.py": "epochal worker: a supervisor that starts its command again",
    "test_torchrun_scripts.py": "a torchrun script under epochal run, its process group its own",
}
"""Each way of starting a run, by the module whose test runs it both ways."""


def both_ways() -> dict[str, list[str]]:
    """The tests marked ``BOTH_STARTS``, by module."""
    found: dict[str, list[str]] = {}
    for path in sorted(INTEGRATION.glob("test_*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef) and any(
                isinstance(d, ast.Name) and d.id == "BOTH_STARTS" for d in node.decorator_list
            ):
                found.setdefault(path.name, []).append(node.name)
    return found


def test_every_way_of_starting_a_run_has_a_test_run_both_ways() -> None:
    marked = both_ways()
    assert marked, "no test runs both forked and fresh (BOTH_STARTS)"
    missing = {name: what for name, what in START_PATHS.items() if name not in marked}
    assert not missing, f"no test of these runs fresh too (mark one BOTH_STARTS): {missing}"


def noted(tmp_path: Path, **env: str) -> list[dict[str, object]]:
    """The notes of one fresh interpreter started with ``env`` on top of a fresh start's."""
    starts = tmp_path / "starts.jsonl"
    given = fresh.environment({**os.environ, PRELOAD_SOCKET_ENV: "/nowhere"}, starts)
    subprocess.run([sys.executable, "-c", "pass"], env={**given, **env}, check=True)
    return fresh.read_starts(starts)  # type: ignore[return-value]


def test_a_fresh_start_names_no_preloaded_process_and_each_interpreter_notes_itself(
    tmp_path: Path,
) -> None:
    env = fresh.environment({PRELOAD_SOCKET_ENV: "/run/preload.sock", "PYTHONPATH": "/x"}, tmp_path)
    assert PRELOAD_SOCKET_ENV not in env
    assert env[PRELOAD_ENV] == "none"  # epochal run's own preloaded process: none either
    assert env["PYTHONPATH"].split(os.pathsep) == [str(fresh.SITE), "/x"]
    (note,) = noted(tmp_path)
    assert note["env"] == {} and note["ppid"] == os.getpid()
    assert fresh.failures([note], started=1) == []


def test_a_process_that_could_have_been_forked_fails_a_fresh_test(tmp_path: Path) -> None:
    (asked,) = noted(tmp_path, **{CHANNEL_ENV: "7"})
    (line,) = fresh.failures([asked], started=1)
    assert f"had {CHANNEL_ENV}=7" in line
    named = {**asked, "env": {PRELOAD_SOCKET_ENV: "/run/preload.sock"}}
    assert f"had {PRELOAD_SOCKET_ENV}=/run/preload.sock" in fresh.failures([named], 1)[0]
    zygote = {**asked, "env": {}, "argv": [sys.executable, "-u", "-P", ZYGOTE_SCRIPT, "3"]}
    assert "a preloaded process that forks" in fresh.failures([zygote], 1)[0]
    assert fresh.failures([], started=2) == [
        "2 processes started fresh, but no interpreter noted its start"
    ]
    assert fresh.failures([], started=0) == []


def test_the_whole_suite_runs_fresh_only_when_asked() -> None:
    assert not fresh.whole_suite({})
    assert not fresh.whole_suite({fresh.FRESH_ENV: "0"})
    assert fresh.whole_suite({fresh.FRESH_ENV: "1"})
