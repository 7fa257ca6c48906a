"""Worker processes attach to a coordinator started inside the test's own process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import epochal
from tests.integration.conftest import Spawner

pytestmark = pytest.mark.slow

DEADLINE = 90.0


def test_two_worker_processes_finish_under_an_in_process_coordinator(
    spawn: Spawner, tmp_path: Path
) -> None:
    lines: list[str] = []
    with epochal.start_coordinator(
        world_size=2, epochs=3, run_dir=tmp_path / "run", log=lines.append
    ) as coordinator:
        workers = [
            spawn.script(
                "linear.py",
                "--out",
                str(tmp_path / "out"),
                EPOCHAL_COORDINATOR=coordinator.endpoint,
            )
            for _ in range(2)
        ]
        for worker in workers:
            code, output = spawn.finish(worker, DEADLINE)
            assert code == 0, output
        summary = coordinator.wait(timeout=DEADLINE)
    assert summary.run_id == coordinator.run_id
    assert summary.epochs_run == 3
    assert [outcome.epoch for outcome in summary.history] == [0, 1, 2]
    assert summary.best_epoch is not None
    assert any(line.startswith("epoch 2 [3/3]") for line in lines), lines
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["status"] == "finished" and result["best_epoch"] == summary.best_epoch
    spawn.assert_none_left()
