"""256 workers against a real ``epochal coordinator`` process, run to the end.

The workers are ``bench/control_plane.py``'s simulated ones (``scripts/sim_workers.py`` imports
its driver): they speak the real protocol through ``epochal.protocol``, without torch, many to a
helper process, so a run of 256 ranks fits on two cores. When the protocol changes, the bench's
``worker_script`` changes with it, and so does this test.

Every bound is a configured timeout: the coordinator ends within its rendezvous timeout plus its
stall abort (after the rendezvous, a run that stops progressing is aborted), and the simulated
workers give up after the same time on their own.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.integration.conftest import Spawner, StandaloneRun

pytestmark = pytest.mark.slow

WORLD = 256
EPOCHS = 3
HELPERS = 4
"""Helper processes the simulated workers are spread over (the bench's default)."""
TRAIN_SECONDS = 0.1
"""Each simulated epoch's training: a sleep."""
HEARTBEAT_INTERVAL = 1.0
RENDEZVOUS_TIMEOUT = 120.0
STALL_ABORT = 60.0
LIMIT = RENDEZVOUS_TIMEOUT + STALL_ABORT
"""The longest the run may take: every worker joined within the rendezvous timeout, then no
stretch of more than the stall abort without progress."""
CLOSE = 5.0
"""A helper's exit after its run: the driver closes its sockets with a linger of 1 s."""

LOG_PROBLEMS = re.compile(r"\blost\b|abort|never arrived|warning|error|traceback", re.IGNORECASE)


@pytest.mark.timeout(int(LIMIT + CLOSE + 60))
def test_256_workers_run_to_the_end(spawn: Spawner, tmp_path: Path) -> None:
    run = StandaloneRun(
        spawn,
        WORLD,
        "--epochs",
        str(EPOCHS),
        "--checkpoint-every",
        "0",  # the simulated workers hold no model
        "--rendezvous-timeout",
        f"{RENDEZVOUS_TIMEOUT:g}",
        "--stall-abort",
        f"{STALL_ABORT:g}",
        "--heartbeat-interval",
        f"{HEARTBEAT_INTERVAL:g}",
    )
    shares = [WORLD // HELPERS + (1 if i < WORLD % HELPERS else 0) for i in range(HELPERS)]
    reports = [tmp_path / f"helper{i}.json" for i in range(HELPERS)]
    helpers = []
    first = 0
    for count, report in zip(shares, reports, strict=True):
        helpers.append(
            spawn.script(
                "sim_workers.py",
                "--endpoint",
                run.endpoint,
                "--first",
                str(first),
                "--count",
                str(count),
                "--heartbeat-interval",
                f"{HEARTBEAT_INTERVAL:g}",
                "--train-seconds",
                f"{TRAIN_SECONDS:g}",
                "--run-timeout",
                f"{LIMIT:g}",
                "--out",
                str(report),
            )
        )
        first += count

    code, output = run.finish_coordinator(LIMIT)
    assert code == 0, output
    for helper in helpers:
        helper_code, helper_output = spawn.finish(helper, LIMIT + CLOSE)
        assert helper_code == 0, helper_output
    spawn.assert_none_left()

    # the coordinator: finished, every epoch journaled once, nothing lost or aborted
    result = json.loads((run.run_dir / "result.json").read_text())
    assert result["status"] == "finished", result
    assert result["epochs_run"] == EPOCHS, result
    records = [json.loads(line) for line in (run.run_dir / "epochs.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if r["kind"] == "epoch"] == list(range(EPOCHS)), records
    assert records[-1]["stop"] and records[-1]["stop_reason"] == "epochs", records[-1]
    assert f"finished after {EPOCHS} epochs" in output, output
    problems = [line for line in output.splitlines() if LOG_PROBLEMS.search(line)]
    assert not problems, "\n".join(problems)
    # where the ranks are: one line per host's run of ranks ("ranks 0-255: vm, ...")
    spans = re.findall(r"^ranks? (\d+)(?:-(\d+))?: ", output, re.MULTILINE)
    placed = sorted(r for a, b in spans for r in range(int(a), int(b or a) + 1))
    assert placed == list(range(WORLD)), output

    # every simulated worker: one rank, a welcome, a go and a decision per epoch, one finish
    workers = [w for report in reports for w in json.loads(report.read_text())]
    assert sorted(w["index"] for w in workers) == list(range(WORLD))
    failed = {w["index"]: w["error"] for w in workers if w["error"] is not None}
    assert not failed, failed
    expected = {"welcome"} | {
        f"{what}.{e}" for e in range(EPOCHS) for what in ("go", "report", "decision")
    }
    for w in workers:
        assert expected <= set(w["marks"]), w
        assert w["finishes"] == 1, w
        assert len(set(w["ranks"])) == 1, w
    assert sorted(w["ranks"][0] for w in workers) == list(range(WORLD))
