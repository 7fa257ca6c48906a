"""What the observers show of a run with epochs of N steps: the step of the epoch under way and
where the data stands (``epochal status``), and the data position as TensorBoard scalars and
Prometheus gauges."""

from __future__ import annotations

from pathlib import Path

from epochal.coordinator.serve.journal import Journal
from epochal.observe.prometheus import Prometheus
from epochal.observe.statusfile import StatusFile, describe
from epochal.observe.tensorboard import TensorBoard
from tests.observe.test_observers import record, scalars, scrape, snapshot, start, value

POSITION = {"steps": 4, "data_pass": 1, "data_offset": 24, "pass_batches": 5, "global_batch": 8}


def test_status_shows_the_step_of_the_epoch_and_the_share_of_the_pass_done(tmp_path: Path):
    journal = Journal(tmp_path)
    journal.start({"run_id": "run0", "config": {"epochs": 10}})
    journal.close()
    status = StatusFile(tmp_path)
    status.on_start(start(tmp_path))
    status.on_epoch(record(0, **POSITION), snapshot(1))
    # rank 0 trains its 7th of 16 batches: step 1 of 4; 24 samples are 3 of 5 global batches
    assert (
        "epochs of 4 steps, step 1/4 of this one; data: pass 1, 24 samples in (60% of the pass)"
        in describe(tmp_path).splitlines()
    )


def test_status_of_a_run_of_passes_says_nothing_of_steps(tmp_path: Path):
    status = StatusFile(tmp_path)
    status.on_start(start(tmp_path))
    status.on_epoch(record(0), snapshot(1))
    assert "steps" not in describe(tmp_path)


def test_tensorboard_and_prometheus_get_the_data_position(tmp_path: Path):
    board = TensorBoard(tmp_path / "tb")
    metrics = Prometheus("127.0.0.1:0")
    try:
        for observer in (board, metrics):
            observer.on_start(start(tmp_path / "run"))
            observer.on_epoch(record(0, **POSITION), snapshot(0))
        families = scrape(metrics)
        assert value(families, "epochal_data_pass") == 1
        assert value(families, "epochal_data_offset") == 24
    finally:
        metrics.close()
        board.close()
    assert board.directory is not None
    got = scalars(board.directory)
    assert got["data/pass"] == [(0, 1.0)] and got["data/offset"] == [(0, 24.0)]
    assert got["data/steps_per_epoch"] == [(0, 4.0)]
