"""epochal plot and RUN_DIR/curve.png, from run directories written by the journal itself."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from matplotlib import image

from epochal import log
from epochal.cli.parser import EXIT_USAGE, main
from epochal.coordinator.serve.journal import Journal
from epochal.observe.plot import (
    figure,
    further_metrics,
    plot_run,
    restart_marks,
    write_curve,
)

PNG = b"\x89PNG\r\n\x1a\n"


def epoch_record(epoch: int, **extra: object) -> dict[str, object]:
    train = 2.0 * math.exp(-epoch / 4) + 0.1
    valid = train + 0.05
    return {
        "kind": "epoch",
        "epoch": epoch,
        "train_loss": train,
        "valid_loss": valid,
        "smoothed_loss": valid,
        "best_epoch": epoch,
        "best_loss": valid,
        "is_best": True,
        "lr_factor": 1.0 if epoch < 5 else 0.5,
        "next_lr_factor": 1.0,
        "seconds": 0.05,
        "time": 1000.0 + epoch,
        "validates": True,
        "checkpoint": True,
        "stop": False,
        "stop_reason": None,
        "train_batches": 16,
        "valid_batches": 6,
        **extra,
    }


def write_run(run_dir: Path, records: list[dict[str, object]], **run: object) -> Path:
    journal = Journal(run_dir)
    journal.start({"run_id": "r1", "resumed_from": None, **run})
    for record in records:
        journal.epoch(record)
    journal.close()
    return run_dir


def test_a_curve_is_a_png_of_the_journal(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", [epoch_record(e) for e in range(8)])
    out = plot_run(run_dir)
    assert out == run_dir / "curve.png"
    assert out.read_bytes().startswith(PNG)
    height, width, _ = image.imread(out).shape
    assert width > height > 300  # a real figure, landscape


def test_further_metrics_are_every_other_number_in_the_records() -> None:
    records = [
        epoch_record(0, accuracy=0.5, metrics={"f1": 0.4, "note": "x"}),
        epoch_record(1, accuracy=0.7, metrics={"f1": 0.6}),
    ]
    found = further_metrics(records)
    assert found == {"accuracy": [(0, 0.5), (1, 0.7)], "f1": [(0, 0.4), (1, 0.6)]}
    # bookkeeping (batches, seconds, time, flags) is not a metric
    assert further_metrics([epoch_record(0)]) == {}
    # the rate the optimizer held is the factor the second axis draws, not a metric again
    assert further_metrics([epoch_record(0, lr=0.05), epoch_record(1, lr=0.025)]) == {}


def test_a_curve_with_metrics_gets_a_second_panel(tmp_path: Path) -> None:
    plain = plot_run(write_run(tmp_path / "a", [epoch_record(e) for e in range(5)]))
    more = plot_run(write_run(tmp_path / "b", [epoch_record(e, accuracy=e / 10) for e in range(5)]))
    assert image.imread(more).shape[0] > image.imread(plain).shape[0]


def drawn_labels(run_dir: Path) -> dict[str, object]:
    """What the curve of ``run_dir`` says: its title, and each panel's y label and legend."""
    from matplotlib import pyplot

    records = [json.loads(line) for line in (run_dir / "epochs.jsonl").read_text().splitlines()]
    fig = figure(pyplot, run_dir, records)
    try:
        panels = [a for a in fig.axes if a.get_ylabel() != "learning-rate factor"]
        legends = [a.get_legend() for a in fig.axes]
        return {
            "title": panels[0].get_title(),
            "panels": [
                (a.get_ylabel(), [x.get_label() for x in a.get_lines() if x.get_label()[0] != "_"])
                for a in panels
            ],
            "legend": {t.get_text() for lg in legends if lg for t in lg.get_texts()},
        }
    finally:
        pyplot.close(fig)


def test_a_monitored_metric_is_drawn_under_its_name_beside_the_metric(tmp_path: Path) -> None:
    accuracy = [0.9, 0.95, 0.93]
    records = [
        epoch_record(
            e,
            smoothed_loss=a,
            best_loss=max(accuracy[: e + 1]),
            best_epoch=accuracy.index(max(accuracy[: e + 1])),
            metrics=["valid_accuracy"],
            valid_accuracy=a,
        )
        for e, a in enumerate(accuracy)
    ]
    config = {"monitor": "accuracy", "monitor_mode": "max"}
    seen = drawn_labels(write_run(tmp_path / "run", records, config=config))
    assert str(seen["title"]).endswith("3 epochs, best epoch 1 (highest smoothed accuracy)")
    (loss_axis, losses), (metric_axis, metrics) = seen["panels"]  # type: ignore[misc]
    assert loss_axis == "loss" and set(losses) == {"train loss", "validation loss"}
    assert metric_axis == "metrics"
    assert {"valid_accuracy", "smoothed accuracy", "best epoch 1 (0.95)"} <= set(metrics)
    assert "smoothed loss" not in seen["legend"]  # type: ignore[operator]
    assert "smoothed accuracy" in seen["legend"]  # type: ignore[operator]


def test_the_loss_monitored_is_drawn_with_the_losses(tmp_path: Path) -> None:
    seen = drawn_labels(write_run(tmp_path / "run", [epoch_record(e) for e in range(3)]))
    ((ylabel, lines),) = seen["panels"]  # type: ignore[misc]
    assert ylabel == "loss" and "smoothed loss" in lines and "best epoch 2 (1.363)" in lines
    assert str(seen["title"]).endswith("3 epochs, best epoch 2 (lowest smoothed loss)")


def test_restarts_come_from_status_json_and_the_latest_resume_from_run_json(
    tmp_path: Path,
) -> None:
    run_dir = write_run(tmp_path / "run", [epoch_record(e) for e in range(6)], resumed_from=3)
    assert restart_marks(run_dir) == [(3.5, "resumed")]
    (run_dir / "status.json").write_text(
        json.dumps(
            {
                "events": [
                    {"kind": "start", "start_epoch": 0},
                    {"kind": "restart", "start_epoch": 2},
                    {"kind": "resume", "start_epoch": 4},
                    {"kind": "restart", "start_epoch": 4},
                    {"kind": "resume", "start_epoch": 4},
                ]
            }
        )
    )
    assert restart_marks(run_dir) == [(1.5, "restart"), (3.5, "resumed, restart")]
    assert plot_run(run_dir).read_bytes().startswith(PNG)


def test_a_half_written_last_line_is_skipped(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", [epoch_record(e) for e in range(3)])
    with open(run_dir / "epochs.jsonl", "a") as f:
        f.write('{"kind": "epoch", "epoch": 3, "train_lo')
    assert plot_run(run_dir).exists()


def test_write_curve_never_fails_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    log.ensure_configured()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert write_curve(empty) is None and not (empty / "curve.png").exists()
    assert write_curve(None) is None
    run_dir = write_run(tmp_path / "run", [epoch_record(0)])
    (run_dir / "curve.png").mkdir()  # in the way: the picture cannot be written
    assert write_curve(run_dir) is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: the learning curve ")
    assert str(run_dir / "curve.png") in err


def test_epochal_plot_writes_the_file_asked_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = write_run(tmp_path / "run", [epoch_record(e) for e in range(4)])
    out = tmp_path / "pictures" / "c.png"
    assert main(["plot", str(run_dir), "-o", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out}\n"
    assert out.read_bytes().startswith(PNG)
    assert main(["plot", str(run_dir)]) == 0
    assert (run_dir / "curve.png").exists()


def test_epochal_plot_of_no_run_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["plot", str(tmp_path)])
    assert exit_.value.code == EXIT_USAGE
    assert "is not a run directory" in capsys.readouterr().err
    write_run(tmp_path / "new", [])
    with pytest.raises(SystemExit) as exit_:
        main(["plot", str(tmp_path / "new")])
    assert exit_.value.code == EXIT_USAGE
    assert "no epoch in its journal" in capsys.readouterr().err


def test_a_change_of_world_is_marked_before_the_epoch_redone_and_not_drawn_as_a_metric():
    from epochal.observe.plot import further_metrics, world_marks

    records = [
        {"kind": "epoch", "epoch": 0, "train_loss": 1.0, "world_size": 4, "generation": 0},
        {"kind": "world", "epoch": 1, "from": 4, "to": 3, "generation": 1},
        {"kind": "world", "epoch": "x", "from": 3, "to": 2},  # a forged record: skipped
        {"kind": "epoch", "epoch": 1, "train_loss": 0.5, "world_size": 3, "generation": 1},
    ]
    assert world_marks(records) == [(0.5, "4 -> 3 workers")]
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert further_metrics(epochs) == {}
