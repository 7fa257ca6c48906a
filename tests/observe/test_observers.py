"""The observers of a run, fed as the coordinator feeds them, read back with real files, the
tensorboard package's own reader and a real HTTP scrape."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from epochal import log
from epochal.cli.argtypes import parse_address
from epochal.cli.parser import EXIT_USAGE, main
from epochal.coordinator.config import CoordinatorConfig
from epochal.coordinator.serve.journal import Journal
from epochal.errors import ConfigError
from epochal.observe import Observers, RankStatus, RunObserver, RunStart, StatusSnapshot, World
from epochal.observe import watching as options
from epochal.observe.curve import Curve
from epochal.observe.prometheus import Prometheus
from epochal.observe.statusfile import StatusFile, describe, ended
from epochal.observe.tensorboard import TensorBoard


def start(
    run_dir: Path | None,
    attempt: int = 0,
    resumed_from: int | None = None,
    monitor: str = "loss",
) -> RunStart:
    return RunStart(
        run_id=f"run{attempt}",
        run_dir=run_dir,
        endpoint="tcp://127.0.0.1:5555",
        world_size=2,
        epochs=10,
        attempt=attempt,
        resumed_from=resumed_from,
        config={"epochs": 10, "monitor": monitor},
    )


def snapshot(epoch: int = 0, state: str = "running", **kw: Any) -> StatusSnapshot:
    rows = [
        RankStatus.from_row((0, "node1", "train", epoch, 7, 0.5, "train.py:40 in step"), 0.2),
        RankStatus.from_row((1, "node2", "waiting", epoch, 16, 3.0, "client.py:9 in wait"), 0.9),
    ]
    return StatusSnapshot(
        run_id="run0",
        state=state,
        epoch=epoch,
        epochs=10,
        world_size=kw.pop("world_size", 2),
        joined=kw.pop("joined", 2),
        ranks=kw.pop("ranks", rows),
        **kw,
    )


def record(epoch: int, **kw: Any) -> dict[str, Any]:
    return {
        "kind": "epoch",
        "epoch": epoch,
        "train_loss": 1.0 / (epoch + 1),
        "valid_loss": 1.5 / (epoch + 1),
        "smoothed_loss": 1.5 / (epoch + 1),
        "best_epoch": epoch,
        "best_loss": 1.5 / (epoch + 1),
        "is_best": True,
        "lr_factor": 1.0,
        "next_lr_factor": 1.0,
        "seconds": 2.5,
        "time": 1_700_000_000.0 + epoch,
        "validates": True,
        "checkpoint": False,
        "stop": False,
        "stop_reason": None,
        "train_batches": 16,
        "valid_batches": 6,
        **kw,
    }


class Recorder(RunObserver):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def on_start(self, start: RunStart) -> None:
        self.calls.append("start")

    def on_epoch(self, record: Mapping[str, Any], status: StatusSnapshot) -> None:
        self.calls.append(f"epoch {record['epoch']}")

    def on_end(self, result: Mapping[str, Any]) -> None:
        self.calls.append("end")

    def close(self) -> None:
        self.calls.append("close")


class Broken(RunObserver):
    def __init__(self) -> None:
        self.closed = 0

    def on_epoch(self, record: Mapping[str, Any], status: StatusSnapshot) -> None:
        raise OSError("disk on fire")

    def close(self) -> None:
        self.closed += 1


# ---------------------------------------------------------------------- the fan-out


def test_an_observer_that_raises_is_dropped_with_one_warning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    log.ensure_configured()
    before, broken, after = Recorder(), Broken(), Recorder()
    observers = Observers([before, broken, after])
    observers.on_start(start(None))
    observers.on_epoch(record(0), snapshot())
    observers.on_epoch(record(1), snapshot(1))
    observers.on_end({"status": "finished"})
    observers.close()
    for seen in (before, after):
        assert seen.calls == ["start", "epoch 0", "epoch 1", "end", "close"]
    assert broken.closed == 1  # closed once when dropped, not called again
    assert len(observers) == 0
    assert capsys.readouterr().err == (
        "warning: Broken failed in on_epoch and is switched off for this run: "
        "OSError: disk on fire\n"
    )


# ---------------------------------------------------------------------- status.json


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_status_json_follows_the_run(tmp_path: Path) -> None:
    clock = Clock()
    status = StatusFile(tmp_path, interval=2.0, clock=clock)
    path = tmp_path / "status.json"
    status.on_start(start(tmp_path))
    data = json.loads(path.read_text())
    assert data["state"] == "rendezvous" and data["restarts"] == 0
    assert data["pid"] == os.getpid()
    assert [e["kind"] for e in data["events"]] == ["start"]
    status.on_join(World(joined=2, world_size=2, hosts=("node1", "node2")))
    assert json.loads(path.read_text())["hosts"] == ["node1", "node2"]

    status.on_epoch(record(0), snapshot(0))  # an epoch is written at once
    data = json.loads(path.read_text())
    assert data["last"]["train_loss"] == 1.0 and data["best_epoch"] == 0
    assert data["ranks"][1] == {
        "rank": 1,
        "host": "node2",
        "phase": "waiting",
        "epoch": 0,
        "step": 16,
        "idle": 3.0,
        "where": "client.py:9 in wait",
        "last_heard": 0.9,
    }
    clock.now = 1.0
    status.on_status(snapshot(1))  # within the interval: not yet
    assert json.loads(path.read_text())["epoch"] == 0
    clock.now = 2.0
    status.on_status(snapshot(1))
    assert json.loads(path.read_text())["epoch"] == 1
    status.on_end({"status": "finished", "best_epoch": 0})
    data = json.loads(path.read_text())
    assert data["state"] == "finished" and data["result"]["best_epoch"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["status.json"]  # no temporary left
    assert path.stat().st_mode & 0o777 == 0o600  # as private as the journal


def test_a_snapshot_after_the_end_does_not_undo_it(tmp_path: Path) -> None:
    status = StatusFile(tmp_path, interval=0.0)
    status.on_start(start(tmp_path))
    status.on_end({"status": "finished"})
    status.on_status(snapshot(9, state="finishing"))  # the coordinator's last heartbeat
    status.on_epoch({"kind": "checkpoint", "epoch": 9}, snapshot(9, state="finishing"))
    data = json.loads((tmp_path / "status.json").read_text())
    assert data["state"] == "finished" and data["epoch"] == 0


def test_the_curve_is_drawn_when_the_observers_close(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.start({"run_id": "run0"})
    journal.epoch(record(0))
    journal.close()
    curve = Curve(tmp_path)
    curve.close()  # never started: nothing was run, nothing drawn
    assert not (tmp_path / "curve.png").exists()
    curve.on_start(start(tmp_path))
    curve.on_end({"status": "finished"})
    assert not (tmp_path / "curve.png").exists()  # not inside the coordinator's event loop
    curve.close()
    assert (tmp_path / "curve.png").read_bytes().startswith(b"\x89PNG")


def test_restarts_and_resumes_are_kept_across_coordinators(tmp_path: Path) -> None:
    first = StatusFile(tmp_path)
    first.on_start(start(tmp_path))
    first.on_end({"status": "aborted", "reason": "rank 1 died"})
    first.on_start(start(tmp_path, attempt=1, resumed_from=2))  # --max-restarts, same process
    assert json.loads((tmp_path / "status.json").read_text())["restarts"] == 1
    # the coordinator process itself is started again and resumes
    second = StatusFile(tmp_path)
    second.on_start(start(tmp_path, resumed_from=5))
    data = json.loads((tmp_path / "status.json").read_text())
    assert [(e["kind"], e["start_epoch"]) for e in data["events"]] == [
        ("start", 0),
        ("restart", 3),
        ("resume", 6),
    ]
    assert data["restarts"] == 1 and "result" not in data
    # a run that starts over at epoch 0 starts a new history
    StatusFile(tmp_path).on_start(start(tmp_path))
    data = json.loads((tmp_path / "status.json").read_text())
    assert [e["kind"] for e in data["events"]] == ["start"]


def test_status_of_a_live_run_shows_each_rank(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.start({"run_id": "run0", "config": {"epochs": 10}})
    journal.close()
    status = StatusFile(tmp_path)
    status.on_start(start(tmp_path))
    status.on_epoch(record(0), snapshot(1))
    text = describe(tmp_path)
    lines = text.splitlines()
    assert lines[0] == f"run run0 in {tmp_path}: running, epoch 1 [2/10], 2/2 workers joined"
    assert lines[1].startswith("updated ") and f"by pid {os.getpid()}" in lines[1]
    assert "last epoch 0: train 1.0000  valid 1.5000  smoothed 1.5000  lr x1  2.50s" in lines
    # the rate the workers' optimizer held, where they said it, with a factor that is not 1
    status.on_epoch(record(1, lr=0.025, lr_factor=0.5), snapshot(2))
    assert "lr 0.025 (x0.5)  2.50s" in describe(tmp_path)
    assert lines[-3].split() == "rank host phase epoch step still for heard at".split()  # noqa: SIM905
    assert lines[-1].split() == "1 node2 waiting 1 16 3.0 s 0.9 s ago client.py:9 in wait".split()  # noqa: SIM905
    assert not ended(tmp_path)


def test_status_of_a_finished_run_comes_from_its_result_and_journal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    journal = Journal(tmp_path)
    journal.start({"run_id": "r9", "config": {"epochs": 3}})
    for epoch in range(3):
        journal.epoch(record(epoch))
    journal.result(
        {"status": "finished", "run_id": "r9", "best_epoch": 2, "best_loss": 0.5, "epochs_run": 3}
    )
    journal.close()  # no status.json: a coordinator without observers
    assert main(["status", str(tmp_path)]) == 0
    assert capsys.readouterr().out == (
        f"run r9 in {tmp_path}: finished after 3 epochs, best epoch 2 (smoothed loss 0.5000)\n"
        "last epoch 2: train 0.3333  valid 0.5000  smoothed 0.5000  lr x1  2.50s\n"
    )
    assert ended(tmp_path)
    assert main(["status", str(tmp_path), "--watch", "0.01"]) == 0  # ended: printed once
    assert capsys.readouterr().out.count("finished after 3 epochs") == 1


def test_watch_repeats_a_live_run_until_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    journal = Journal(tmp_path)
    journal.start({"run_id": "run0", "config": {"epochs": 10}})
    status = StatusFile(tmp_path)
    status.on_start(start(tmp_path))
    status.on_epoch(record(0), snapshot(1))
    waits: list[float] = []

    def sleep(seconds: float) -> None:  # the run goes on while status waits, then ends
        waits.append(seconds)
        journal.epoch(record(len(waits)))
        if len(waits) == 2:
            result = {"status": "finished", "best_epoch": 2, "best_loss": 0.5, "epochs_run": 3}
            journal.result(result)
            status.on_end(result)

    monkeypatch.setattr("time.sleep", sleep)
    assert main(["status", str(tmp_path), "--watch", "3"]) == 0
    journal.close()
    views = capsys.readouterr().out.split("\n\n")
    assert waits == [3.0, 3.0]
    assert [v.splitlines()[0].split(": ", 1)[1] for v in views] == [
        "running, epoch 1 [2/10], 2/2 workers joined",
        "running, epoch 1 [2/10], 2/2 workers joined",
        "finished after 3 epochs, best epoch 2 (smoothed loss 0.5000)",
    ]
    assert "last epoch 1: " in views[1] and "rank  host" in views[1]


def accuracy_record(epoch: int, accuracy: float) -> dict[str, Any]:
    """An epoch of a run that monitors its validation accuracy (max)."""
    return record(
        epoch,
        smoothed_loss=accuracy,
        best_loss=accuracy,
        metrics=["valid_accuracy"],
        valid_accuracy=accuracy,
    )


def test_status_names_the_monitored_value_it_shows(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.start({"run_id": "run0", "config": {"epochs": 10, "monitor": "accuracy"}})
    journal.epoch(accuracy_record(0, 0.9))
    status = StatusFile(tmp_path)
    status.on_start(start(tmp_path, monitor="accuracy"))
    status.on_epoch(accuracy_record(0, 0.9), snapshot(1))
    live = describe(tmp_path)
    assert "best so far: epoch 0 (smoothed accuracy 0.9000)" in live
    assert "valid 1.5000  smoothed accuracy 0.9000  valid accuracy 0.9000" in live
    assert "loss 0.9" not in live
    result = {"status": "finished", "run_id": "run0", "best_epoch": 0, "best_loss": 0.9}
    journal.result({**result, "epochs_run": 1})
    journal.close()
    status.on_end(result)
    (tmp_path / "status.json").unlink()  # the name comes from run.json alone too
    assert (
        describe(tmp_path)
        .splitlines()[0]
        .endswith("finished after 1 epoch, best epoch 0 (smoothed accuracy 0.9000)")
    )


def test_status_says_each_ranks_step_of_its_phase_and_when_the_epoch_ends(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.start({"run_id": "run0", "config": {"epochs": 10}})
    journal.close()
    status = StatusFile(tmp_path)
    status.on_start(start(tmp_path))
    rows = [
        dataclasses.replace(
            RankStatus.from_row((0, "node1", "train", 1, 2246, 0.5, "train.py:40 in step"), 0.2),
            steps=4000,
        ),
        RankStatus.from_row((1, "node2", "waiting", 0, 0, 3.0, "client.py:9 in wait"), 0.9),
    ]
    taken = time.time()
    status.on_epoch(record(0), snapshot(1, ranks=rows, epoch_ends_in=95.0, time=taken))
    lines = describe(tmp_path, now=taken + 5).splitlines()
    assert "epoch 1 ends in about 90 s (at the rate its slowest rank went so far)" in lines
    (row,) = [line for line in lines if line.startswith("0 ")]
    assert row.split()[4] == "2246/4000"
    (other,) = [line for line in lines if line.startswith("1 ")]
    assert other.split()[4] == "0"  # a rank waiting has no steps to count


def test_an_aborted_attempt_that_was_restarted_reads_as_live(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    status = StatusFile(tmp_path)
    status.on_start(start(tmp_path))
    journal.result({"status": "aborted", "run_id": "run0", "reason": "rank 1 died"})
    journal.close()
    status.on_end({"status": "aborted", "reason": "rank 1 died"})
    assert describe(tmp_path).splitlines()[0].endswith("aborted: rank 1 died")
    status.on_start(start(tmp_path, attempt=1, resumed_from=0))
    assert not ended(tmp_path)
    text = describe(tmp_path)
    assert text.splitlines()[0].endswith("rendezvous, epoch 1 [2/10], 0/2 workers joined")
    assert "restarts: 1 (restart at epoch 1)" in text


def test_a_coordinator_that_died_is_named(tmp_path: Path) -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    StatusFile(tmp_path).on_start(start(tmp_path))
    data = json.loads((tmp_path / "status.json").read_text())
    data["pid"] = int(gone.stdout)
    (tmp_path / "status.json").write_text(json.dumps(data))
    assert "which is no longer running" in describe(tmp_path)


def test_status_of_no_run_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["status", str(tmp_path)])
    assert exit_.value.code == EXIT_USAGE
    assert "is not a run directory" in capsys.readouterr().err


# ---------------------------------------------------------------------- TensorBoard


def scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def elastic_journal(run_dir: Path) -> None:
    """A finished elastic run: 4 workers in epoch 0, rank 3 lost in epoch 1, which the other
    three redo from memory; a world record of epoch 2 that a later restore superseded."""
    journal = Journal(run_dir)
    journal.start({"run_id": "e1", "config": {"epochs": 3}})
    journal.epoch(record(0, world_size=4, generation=0))
    lost = {"lost": ["rank 3 (worker w3 on node4, pid 44)"], "joined": [], "seconds": 0.8}
    journal.epoch(
        {"kind": "world", "epoch": 1, "generation": 1, "from": 4, "to": 3, "restore": "memory"}
        | lost
    )
    journal.epoch(record(1, world_size=3, generation=1))
    journal.epoch(record(2, world_size=3, generation=1))
    journal.result(
        {"status": "finished", "run_id": "e1", "best_epoch": 2, "best_loss": 0.5, "epochs_run": 3}
    )
    journal.close()


def test_status_shows_each_change_of_an_elastic_world(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    elastic_journal(tmp_path)
    assert main(["status", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[2:] == [
        "world changed before epoch 1: 4 -> 3 workers (generation 1; lost rank 3 (worker w3 on "
        "node4, pid 44); restored from memory; 0.8 s)"
    ]
    journal = Journal(tmp_path)  # a grown world, its state from rank 0 and then a checkpoint
    joined = {"lost": [], "joined": ["w9"], "seconds": 0.4, "restore": "peers"}
    journal.epoch({"kind": "world", "epoch": 3, "generation": 2, "from": 3, "to": 4} | joined)
    restored = {"restore": "checkpoint", "checkpoint": 2, "lost": ["rank 0 (w0)"], "joined": []}
    journal.epoch({"kind": "world", "epoch": 3, "generation": 3, "from": 4, "to": 3} | restored)
    journal.close()
    assert main(["status", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[3:] == [
        "world changed before epoch 3: 3 -> 4 workers (generation 2; joined w9; state sent from "
        "rank 0; 0.4 s)",
        "world changed before epoch 3: 4 -> 3 workers (generation 3; lost rank 0 (w0); restored "
        "from the checkpoint of epoch 2)",
    ]


def test_tensorboard_and_prometheus_show_the_size_of_an_elastic_world(tmp_path: Path) -> None:
    board = TensorBoard(tmp_path / "tb")
    metrics = Prometheus("127.0.0.1:0")
    try:
        for observer in (board, metrics):
            observer.on_start(start(tmp_path / "run"))
            observer.on_epoch(record(0, world_size=4, generation=0), snapshot(0, world_size=4))
        assert value(scrape(metrics), "epochal_world_size") == 4
        world = {"kind": "world", "epoch": 1, "generation": 1, "from": 4, "to": 3}
        for observer in (board, metrics):
            observer.on_epoch(world, snapshot(1, world_size=3, joined=3))
            observer.on_epoch(record(1, world_size=3, generation=1), snapshot(1, world_size=3))
        assert value(scrape(metrics), "epochal_world_size") == 3
    finally:
        metrics.close()
        board.close()
    assert board.directory is not None
    got = scalars(board.directory)
    assert got["world/size"] == [(0, 4.0), (1, 3.0)]
    assert got["world/generation"] == [(0, 0.0), (1, 1.0)]


def test_tensorboard_gets_every_journaled_scalar(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "digits"
    board = TensorBoard(tmp_path / "tb")
    board.on_start(start(run_dir))
    for epoch in range(3):
        board.on_epoch(record(epoch, accuracy=0.5 + epoch / 10), snapshot(epoch))
        board.on_epoch({"kind": "checkpoint", "epoch": epoch, "time": 1.0}, snapshot(epoch))
    board.close()
    assert board.directory == tmp_path / "tb" / "digits"  # one writer, named after the run
    got = scalars(board.directory)
    assert sorted(got) == sorted(
        [
            "loss/train",
            "loss/valid",
            "loss/smoothed",
            "loss/best",
            "best/epoch",
            "lr/factor",
            "lr/next_factor",
            "time/epoch_seconds",
            "batches/train",
            "batches/valid",
            "metrics/accuracy",
        ]
    )
    assert got["loss/train"] == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
    assert got["metrics/accuracy"] == [(0, 0.5), (1, pytest.approx(0.6)), (2, pytest.approx(0.7))]


def test_tensorboard_names_a_monitored_metric_s_smoothed_and_best_values(tmp_path: Path) -> None:
    board = TensorBoard(tmp_path / "tb")
    board.on_start(start(tmp_path / "run", monitor="accuracy"))
    for epoch in range(2):
        board.on_epoch(accuracy_record(epoch, 0.8 + epoch / 10), snapshot(epoch))
    board.close()
    got = scalars(tmp_path / "tb" / "run")
    assert "loss/smoothed" not in got and "loss/best" not in got
    assert got["metrics/smoothed_accuracy"] == [(0, pytest.approx(0.8)), (1, pytest.approx(0.9))]
    assert got["metrics/best_accuracy"] == got["metrics/smoothed_accuracy"]
    assert got["metrics/valid_accuracy"] == got["metrics/smoothed_accuracy"]
    assert got["loss/valid"] == [(0, 1.5), (1, 0.75)]


def test_tensorboard_drops_the_epochs_a_resume_trains_again(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = TensorBoard(tmp_path / "tb")
    first.on_start(start(run_dir))
    for epoch in range(5):
        first.on_epoch(record(epoch), snapshot(epoch))
    first.close()  # the coordinator died after epoch 4; the last checkpoint is epoch 2
    second = TensorBoard(tmp_path / "tb")
    second.on_start(start(run_dir, resumed_from=2))
    for epoch in (3, 4):
        second.on_epoch(record(epoch, train_loss=9.0 + epoch), snapshot(epoch))
    second.close()
    got = scalars(tmp_path / "tb" / "run")["loss/train"]
    assert got == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3)), (3, 12.0), (4, 13.0)]


def test_without_tensorboard_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "tensorboard.compat", None)
    monkeypatch.setitem(sys.modules, "tensorboard.compat.proto", None)
    with pytest.raises(ConfigError, match=r"pip install 'epochal\[tensorboard\]'"):
        TensorBoard(Path("tb"))


# ---------------------------------------------------------------------- Prometheus


def scrape(metrics: Prometheus) -> dict[str, Any]:
    with urllib.request.urlopen(metrics.url) as response:
        assert response.status == 200
        text = response.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(families: dict[str, Any], name: str, sample: str | None = None) -> float:
    for s in families[name].samples:
        if s.name == (sample or name):
            assert s.labels == {} or "le" in s.labels
            return float(s.value)
    raise KeyError(sample or name)


def test_prometheus_serves_the_run_over_http() -> None:
    metrics = Prometheus("127.0.0.1:0")
    try:
        assert metrics.url.startswith("http://127.0.0.1:")
        before = scrape(metrics)
        assert "epochal_train_loss" not in before and "epochal_epoch" not in before  # no value
        metrics.on_start(start(None))
        metrics.on_join(World(joined=1, world_size=2))
        assert value(scrape(metrics), "epochal_workers_joined") == 1
        metrics.on_status(snapshot(0, refused=2))
        for epoch in range(3):
            metrics.on_epoch(record(epoch), snapshot(epoch, round_seconds=0.02, refused=3))
        metrics.on_start(start(None, attempt=1, resumed_from=1))  # restarted after a failure
        metrics.on_status(snapshot(2, refused=1))  # the new coordinator counts from 0 again
        metrics.on_end({"status": "aborted", "reason": "x"})
        got = scrape(metrics)
        assert value(got, "epochal_epoch") == 2
        assert value(got, "epochal_world_size") == 2
        assert value(got, "epochal_workers_joined") == 2
        assert value(got, "epochal_train_loss") == pytest.approx(1 / 3)
        assert value(got, "epochal_valid_loss") == pytest.approx(0.5)
        assert value(got, "epochal_smoothed_loss") == pytest.approx(0.5)
        assert value(got, "epochal_best_epoch") == 2
        assert value(got, "epochal_epoch_seconds", "epochal_epoch_seconds_count") == 3
        assert value(got, "epochal_epoch_seconds", "epochal_epoch_seconds_sum") == 7.5
        assert value(got, "epochal_control_round_seconds", "epochal_control_round_seconds_count")
        assert value(got, "epochal_restarts", "epochal_restarts_total") == 1
        assert value(got, "epochal_refused", "epochal_refused_total") == 4
        assert value(got, "epochal_aborted") == 1
        for family in got.values():  # no per-rank (or any other) labels
            assert all(set(s.labels) <= {"le"} for s in family.samples), family.name
        assert REGISTRY.get_sample_value("epochal_epoch") is None  # its own registry
    finally:
        metrics.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(metrics.url, timeout=5)


def test_prometheus_shows_only_values_the_run_has_under_the_names_it_monitors() -> None:
    metrics = Prometheus("127.0.0.1:0")
    try:
        metrics.on_start(start(None, monitor="accuracy"))
        metrics.on_status(snapshot(0, state="rendezvous"))
        metrics.on_status(snapshot(0, state="ready"))
        waiting = scrape(metrics)
        # no epoch runs yet: absent (Prometheus's "no value"), not 0, which is a real epoch
        for name in ("epochal_epoch", "epochal_best_epoch", "epochal_train_loss"):
            assert name not in waiting, name
        assert value(waiting, "epochal_world_size") == 2
        metrics.on_status(snapshot(0))
        assert value(scrape(metrics), "epochal_epoch") == 0
        metrics.on_epoch(
            record(
                0,
                smoothed_loss=0.9,
                metrics=["train_accuracy", "valid_accuracy"],
                train_accuracy=0.7,
                valid_accuracy=0.9,
            ),
            snapshot(1),
        )
        metrics.on_epoch(record(1, smoothed_loss=0.95, metrics=["train_accuracy"]), snapshot(2))
        got = scrape(metrics)
        assert value(got, "epochal_epoch") == 2
        assert value(got, "epochal_valid_accuracy") == 0.9  # the last epoch that reported it
        assert value(got, "epochal_train_accuracy") == 0.7
        assert value(got, "epochal_smoothed_accuracy") == 0.95  # named by what it smooths
        assert "epochal_smoothed_loss" not in got
        assert value(got, "epochal_valid_loss") == pytest.approx(0.75)
        metrics.on_start(start(None, attempt=1, resumed_from=1, monitor="accuracy"))
        restarted = scrape(metrics)
        assert "epochal_epoch" not in restarted  # the new attempt has not started an epoch
        assert value(restarted, "epochal_valid_accuracy") == 0.9  # the run's last values stay
    finally:
        metrics.close()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("9400", ("127.0.0.1", 9400)),
        ("0.0.0.0:9400", ("0.0.0.0", 9400)),
        ("[::1]:9400", ("::1", 9400)),
        (":9400", ("127.0.0.1", 9400)),
    ],
)
def test_metrics_addresses(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize("text", ["", "host:", "host:http", "1.2.3.4:70000"])
def test_bad_metrics_addresses_say_the_form(text: str) -> None:
    with pytest.raises(ConfigError, match="HOST:PORT or PORT"):
        parse_address(text)


def test_a_taken_metrics_port_is_said_before_the_run(tmp_path: Path) -> None:
    taken = Prometheus("127.0.0.1:0")
    try:
        with pytest.raises(OSError, match=r"cannot serve metrics at 127\.0\.0\.1:\d+"):
            options.build(tmp_path, metrics_address=f"127.0.0.1:{taken.port}")
    finally:
        taken.close()


def test_options_build_the_observers_asked_for(tmp_path: Path) -> None:
    from epochal.cli.parser import _config, build_parser

    argv = ["run", "--nproc", "2", "--tensorboard", str(tmp_path / "tb")]
    args = build_parser().parse_args([*argv, "--metrics-address", "0", "s.py"])
    config = _config(args, 2, "", "RUN")
    assert config.tensorboard == tmp_path / "tb" and config.metrics_address == "0"
    observers = options.from_config(config)
    try:
        kinds = [type(o).__name__ for o in observers._observers]
        assert kinds == ["StatusFile", "Curve", "TensorBoard", "Prometheus"]
    finally:
        observers.close()
    quiet_args = build_parser().parse_args(["coordinator", "--world-size", "2", "--no-status"])
    quiet = _config(quiet_args, 2, "", "RUN")
    assert len(options.from_config(quiet)) == 0


def test_a_bad_metrics_address_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from epochal.cli.parser import build_parser

    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args(["coordinator", "--metrics-address", "host:port"])
    assert exit.value.code == 2
    assert "HOST:PORT or PORT" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="HOST:PORT or PORT"):
        CoordinatorConfig(world_size=1, metrics_address="nowhere")


def test_observers_import_neither_torch_nor_their_libraries_until_used() -> None:
    code = (
        "import sys\n"
        "import epochal.observe.watching, epochal.observe.statusfile, epochal.observe.plot\n"
        "heavy = [m for m in ('torch', 'matplotlib', 'tensorboard', 'prometheus_client')"
        " if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "[]"


def test_the_last_epoch_line_shows_the_journaled_metrics(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.epoch(
        {
            **record(0),
            "metrics": ["train_accuracy", "valid_accuracy"],
            "train_accuracy": 0.75,
            "valid_accuracy": 0.5,
        }
    )
    journal.result({"status": "finished", "best_epoch": 0, "best_loss": 0.5, "epochs_run": 1})
    journal.close()
    line = next(t for t in describe(tmp_path).splitlines() if t.startswith("last epoch 0: "))
    assert "train accuracy 0.7500  valid accuracy 0.5000" in line


def test_joins_are_written_at_most_every_interval_and_at_once_when_all_are_in(
    tmp_path: Path,
) -> None:
    clock = Clock()
    status = StatusFile(tmp_path, interval=2.0, clock=clock)
    path = tmp_path / "status.json"
    status.on_start(start(tmp_path))
    for joined in (1, 2, 3):  # a rendezvous of many: not one file per worker
        status.on_join(World(joined=joined, world_size=4))
    assert json.loads(path.read_text())["joined"] == 0
    clock.now += 2.0
    status.on_join(World(joined=3, world_size=4))
    assert json.loads(path.read_text())["joined"] == 3
    status.on_join(World(joined=4, world_size=4))  # the last one: at once
    assert json.loads(path.read_text())["joined"] == 4


@pytest.mark.parametrize(
    ("package", "make", "option", "extra"),
    [
        ("prometheus_client", lambda tmp: Prometheus("0"), "--metrics-address", "metrics"),
        ("tensorboard", lambda tmp: TensorBoard(tmp / "tb"), "--tensorboard", "tensorboard"),
    ],
    ids=["metrics", "tensorboard"],
)
def test_an_observer_whose_extra_is_not_installed_says_which_to_install(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    package: str,
    make: Any,
    option: str,
    extra: str,
):
    # a module set to None in sys.modules fails to import, as one never installed does
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(ConfigError) as refused:
        make(tmp_path)
    assert str(refused.value).startswith(f"{option} needs the ")
    assert f"pip install 'epochal[{extra}]'" in str(refused.value)
