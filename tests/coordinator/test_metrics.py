"""Named metrics: summed over ranks by samples, journaled flat, shown, and monitorable.

Expected values are worked out by hand, or against the same computation done in one process
over all the samples at once.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epochal.coordinator.config import CoordinatorConfig
from epochal.coordinator.rules import ending
from epochal.coordinator.rules.batches import EpochPlan, PolicyViolation
from epochal.coordinator.rules.loop import LoopState
from epochal.coordinator.rules.outcome import EpochOutcome, format_epoch_line
from epochal.coordinator.rules.schedule import parse_schedule
from epochal.coordinator.rules.sums import LossSums, aggregate_metrics, metric_values
from epochal.protocol.messages import Go, Metric

PROPERTY = settings(max_examples=200, deadline=None)


def report(
    correct: float, n: int, *, valid: tuple[float, int] | None = None, loss: float = 1.0
) -> LossSums:
    """One rank's report: ``correct`` of ``n`` training samples, and optionally validation."""
    vc, vn = valid if valid is not None else (0.0, 0)
    return LossSums(
        train_sum=loss * n,
        train_count=n,
        valid_sum=loss * vn,
        valid_count=vn,
        train_metrics={"accuracy": (correct, n)},
        valid_metrics={"accuracy": (vc, vn)} if valid is not None else {},
    )


def test_metrics_are_weighted_by_samples_not_averaged_over_ranks():
    # rank 0: 1 of 1 right (100%), rank 1: 1 of 3 right (33%); 2 of 4 samples in all is 50%,
    # where the mean of the ranks' means would say 66.7%
    sums = aggregate_metrics({0: report(1.0, 1), 1: report(1.0, 3)})
    assert sums["train"] == {"accuracy": (2.0, 4)}
    assert metric_values(sums) == {"train_accuracy": 0.5}


def test_uneven_shards_of_three_ranks_equal_one_process_over_all_samples():
    # 10 samples split 5/3/2, each right or wrong; one process sees all of them
    right = [1, 1, 0, 1, 0, 1, 1, 1, 0, 0]
    shards = [right[:5], right[5:8], right[8:]]
    reports = {rank: report(float(sum(s)), len(s)) for rank, s in enumerate(shards)}
    values = metric_values(aggregate_metrics(reports))
    assert values == {"train_accuracy": sum(right) / len(right)}


@PROPERTY
@given(st.lists(st.lists(st.integers(0, 1000), min_size=1, max_size=20), min_size=1, max_size=6))
def test_aggregate_equals_the_mean_over_all_samples(shards: list[list[int]]):
    # per-sample scores (whole numbers: every sum is exact, so == compares the weighting alone)
    reports = {rank: report(float(sum(s)), len(s)) for rank, s in enumerate(shards)}
    everything = [x for s in shards for x in s]
    value = metric_values(aggregate_metrics(reports))["train_accuracy"]
    assert value == sum(everything) / len(everything)


def test_ranks_that_did_not_validate_report_no_validation_metrics():
    sums = aggregate_metrics({0: report(1.0, 2, valid=(3.0, 4)), 1: report(2.0, 2)})
    # rank 1 validated no samples: it reports no validation metrics, and that is no mismatch
    assert sums["valid"] == {"accuracy": (3.0, 4)}
    sums = aggregate_metrics({0: report(1.0, 2, valid=(3.0, 4)), 1: report(2.0, 2, valid=(1, 4))})
    assert metric_values(sums) == {"train_accuracy": 0.75, "valid_accuracy": 0.5}


def test_ranks_reporting_different_metrics_are_named():
    other = LossSums(1.0, 1, 0.0, 0, train_metrics={"recall": (1.0, 1)})
    with pytest.raises(PolicyViolation) as info:
        aggregate_metrics({0: report(1.0, 1), 1: report(1.0, 1), 2: other})
    assert "ranks 0-1 accuracy; rank 2 recall" in str(info.value)
    assert "every rank must compute the same metrics" in str(info.value)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_metric_is_a_violation_naming_the_rank(bad: float):
    with pytest.raises(PolicyViolation, match="training metric 'accuracy' of rank 1"):
        aggregate_metrics({0: report(1.0, 1), 1: report(bad, 1)})


def test_infinities_of_both_signs_on_two_ranks_name_both_ranks():
    """fsum of +inf and -inf raises ValueError, not an overflow: the ranks are named first."""
    with pytest.raises(PolicyViolation, match="metric 'accuracy' of ranks 1-2 is not finite"):
        aggregate_metrics({0: report(1.0, 1), 1: report(math.inf, 1), 2: report(-math.inf, 1)})


def test_metric_sums_that_overflow_together_name_the_ranks():
    with pytest.raises(PolicyViolation, match="metric 'accuracy' of ranks 0-1 is not finite"):
        aggregate_metrics({0: report(1.5e308, 1), 1: report(1.5e308, 1)})


def test_a_metric_without_samples_has_no_value():
    assert metric_values({"train": {"accuracy": (0.0, 0)}, "valid": {}}) == {}


# ------------------------------------------------------------------ monitoring a metric

# Loss and accuracy disagree: the loss is lowest at epoch 1, the accuracy highest at epoch 2.
LOSSES = [1.0, 0.5, 0.75, 0.875]
ACCURACIES = [0.5, 0.625, 0.875, 0.75]


def run(loop: LoopState, validates: bool = True) -> list[EpochOutcome]:
    split = "valid" if validates else "train"
    return [
        loop.update(
            epoch,
            2.0,
            loss if validates else None,
            validates=validates,
            metrics={f"{split}_accuracy": acc},
        )
        for epoch, (loss, acc) in enumerate(zip(LOSSES, ACCURACIES, strict=True))
    ]


def test_by_default_the_loss_picks_the_best_epoch_whatever_the_metrics():
    loop = LoopState(epochs=4)
    run(loop)
    assert (loop.best_epoch, loop.best_loss) == (1, 0.5)


def test_monitoring_accuracy_at_max_picks_the_most_accurate_epoch():
    loop = LoopState(epochs=4, monitor="accuracy", mode="max")
    outcomes = run(loop)
    assert (loop.best_epoch, loop.best_loss) == (2, 0.875)
    assert [o.is_best for o in outcomes] == [True, True, True, False]
    assert [o.smoothed_loss for o in outcomes] == ACCURACIES


def test_monitoring_accuracy_at_min_picks_the_least_accurate_epoch():
    loop = LoopState(epochs=4, monitor="accuracy", mode="min")
    run(loop)
    assert (loop.best_epoch, loop.best_loss) == (0, 0.5)


def test_without_validation_the_training_metric_is_monitored():
    loop = LoopState(epochs=4, monitor="accuracy", mode="max")
    run(loop, validates=False)
    assert loop.best_epoch == 2


def test_a_monitored_metric_is_smoothed():
    # a = 0.5: 0.5, 0.5625, 0.71875, 0.734375: the smoothed value rises to the last epoch
    loop = LoopState(epochs=4, smoothing=0.5, monitor="accuracy", mode="max")
    outcomes = run(loop)
    assert [o.smoothed_loss for o in outcomes] == [0.5, 0.5625, 0.71875, 0.734375]
    assert loop.best_epoch == 3


def test_patience_at_max_counts_epochs_that_do_not_raise_the_best():
    loop = LoopState(epochs=10, monitor="accuracy", mode="max", patience=0, min_delta=0.125)
    outcomes = run(loop)
    # 0.625 is not more than 0.5 + 0.125: stale once, over patience 0
    assert [o.stop for o in outcomes[:2]] == [False, True]
    assert outcomes[1].stop_reason == "patience"


def test_the_plateau_schedule_follows_a_maximised_metric():
    schedule = parse_schedule("plateau:patience=0,factor=0.5,threshold=0,min=0", 10)
    loop = LoopState(epochs=10, monitor="accuracy", mode="max", schedule=schedule)
    outcomes = run(loop)
    # rising accuracy keeps the factor; the drop at epoch 3 halves it
    assert [o.next_lr_factor for o in outcomes] == [1.0, 1.0, 1.0, 0.5]


def test_a_negative_best_keeps_a_relative_plateau_threshold_in_the_right_direction():
    schedule = parse_schedule("plateau:patience=0,factor=0.5,threshold=0.1,min=0", 10)
    state: dict[str, object] = {}
    assert schedule.next_factor(0, -1.0, 1.0, state) == 1.0
    # -1.05 is lower (better) than -1.0, but not by 10% of it: a plateau
    assert schedule.next_factor(1, -1.05, 1.0, state) == 0.5
    assert schedule.next_factor(2, -1.2, 0.5, state) == 0.5  # 20% better: the new best


def test_a_monitored_metric_nobody_reports_is_a_violation_naming_those_there_are():
    loop = LoopState(epochs=4, monitor="acuracy", mode="max")
    with pytest.raises(PolicyViolation) as info:
        loop.update(0, 2.0, 1.0, validates=True, metrics={"valid_accuracy": 0.5})
    message = str(info.value)
    assert "--monitor acuracy: the workers report no validation metric of that name" in message
    assert "(they report loss, accuracy)" in message
    assert loop.history == [] and loop.smoothed is None  # nothing changed


@pytest.mark.parametrize(
    ("monitor", "fix"),
    [
        ("acc", "did you mean --monitor accuracy? Else add 'acc'"),  # a shortening
        ("acuracy", "did you mean --monitor accuracy? Else add 'acuracy'"),  # a misspelling
        ("f1", "monitor one of those, or add 'f1'"),  # nothing close
    ],
)
def test_a_misspelt_monitored_metric_is_answered_with_the_likeliest(monitor: str, fix: str):
    loop = LoopState(epochs=4, monitor=monitor, mode="max")
    metrics = {"valid_accuracy": 0.5, "valid_top5": 0.9, "train_accuracy": 0.4}
    with pytest.raises(PolicyViolation) as info:
        loop.update(0, 2.0, 1.0, validates=True, metrics=metrics)
    assert str(info.value) == (
        f"--monitor {monitor}: the workers report no validation metric of that name (they "
        f"report loss, accuracy, top5): {fix} to the training code's metrics"
    )


def test_an_epoch_that_did_not_validate_leaves_a_monitored_metric_alone():
    loop = LoopState(epochs=4, monitor="accuracy", mode="max")
    loop.update(0, 2.0, 1.0, validates=True, metrics={"valid_accuracy": 0.5})
    outcome = loop.update(1, 2.0, None, validates=True, metrics={"train_accuracy": 0.9})
    assert outcome.smoothed_loss is None and loop.best_epoch == 0 and loop.smoothed == 0.5


def test_replaying_the_journal_rebuilds_the_monitored_state_exactly():
    schedule = parse_schedule("plateau:patience=0,factor=0.5,threshold=0.01,min=0", 10)

    def make() -> LoopState:
        return LoopState(
            epochs=10, smoothing=0.3, monitor="accuracy", mode="max", schedule=schedule
        )

    loop = make()
    records = [
        json.loads(
            json.dumps(
                o.record(validates=True, checkpoint=False, plan=EpochPlan(4, 2), seconds=0.5)
            )
        )
        for o in run(loop)
    ]
    replayed = make()
    for r in records:
        replayed.update(
            r["epoch"],
            r["train_loss"],
            r["valid_loss"],
            validates=r["validates"],
            metrics={key: r[key] for key in r["metrics"]},
        )
    assert replayed == loop


# ------------------------------------------------------------------ journal, decision, line


def test_the_journal_holds_each_metric_as_a_flat_number_and_reads_it_back():
    loop = LoopState(epochs=3)
    outcome = loop.update(
        0, 2.0, 1.5, validates=True, metrics={"train_accuracy": 0.5, "valid_accuracy": 0.75}
    )
    record = outcome.record(validates=True, checkpoint=False, plan=EpochPlan(4, 2), seconds=1.0)
    assert record["valid_accuracy"] == 0.75 and record["train_accuracy"] == 0.5
    assert record["metrics"] == ["train_accuracy", "valid_accuracy"]
    assert EpochOutcome.from_record(json.loads(json.dumps(record))) == outcome


def test_a_journal_line_written_before_metrics_reads_as_none():
    loop = LoopState(epochs=3)
    record = loop.update(0, 2.0, 1.5, validates=True).record(
        validates=True, checkpoint=False, plan=EpochPlan(4, 2), seconds=1.0
    )
    del record["metrics"]
    assert EpochOutcome.from_record(record).metrics == {}


def test_the_decision_carries_the_summed_metrics():
    outcome = LoopState(epochs=3).update(0, 2.0, 1.5, validates=True)
    sums = {"train": {"accuracy": (3.0, 4)}, "valid": {"accuracy": (5.0, 8), "f1": (1.0, 8)}}
    go = Go(epoch=1, train_batches=1, valid_batches=1, lr_factor=1.0)
    decision = outcome.decision(checkpoint=False, sums=sums, go=go)
    assert decision.train_metrics == (Metric("accuracy", 3.0, 4),)
    assert decision.valid_metrics == (Metric("accuracy", 5.0, 8), Metric("f1", 1.0, 8))


def test_the_epoch_line_shows_the_validation_metrics_compactly():
    outcome = LoopState(epochs=3).update(
        0, 2.0, 1.5, validates=True, metrics={"train_accuracy": 0.5, "valid_accuracy": 0.96111}
    )
    line = format_epoch_line(outcome, 3, 0.5)
    assert "valid 1.5000  valid accuracy 0.9611  smoothed 1.5000" in line
    assert "train accuracy" not in line


def test_the_epoch_line_shows_the_training_metrics_of_an_epoch_that_did_not_validate():
    outcome = LoopState(epochs=3).update(
        0, 2.0, None, validates=False, metrics={"train_accuracy": 0.5}
    )
    assert "valid -  train accuracy 0.5000  smoothed" in format_epoch_line(outcome, 3, 0.5)


def test_the_epoch_line_names_a_monitored_metric_it_smooths():
    loop = LoopState(epochs=3, monitor="accuracy", mode="max")
    outcome = loop.update(0, 2.0, 1.5, validates=True, metrics={"valid_accuracy": 0.9})
    line = format_epoch_line(outcome, 3, 0.5, monitor="accuracy")
    assert "valid accuracy 0.9000  smoothed accuracy 0.9000  lr x1  best 0 (0.9000)" in line


def test_a_run_of_one_epoch_is_said_in_the_singular():
    loop = LoopState(epochs=1)
    loop.update(0, 2.0, 1.5, validates=True)
    _, line = ending.finish(loop, CoordinatorConfig(world_size=1, epochs=1), "r1")
    assert line == "run r1 finished after 1 epoch: best epoch 0 (smoothed loss 1.5000)"


def test_the_epoch_line_says_where_the_data_stands_in_epochs_of_n_steps():
    outcome = LoopState(epochs=3).update(0, 2.0, 1.5, validates=True)
    position = {
        "steps": 10,
        "data_pass": 1,
        "data_offset": 384,
        "pass_batches": 16,
        "global_batch": 64,
    }
    line = format_epoch_line(outcome, 3, 0.5, position=position)
    assert line.startswith("epoch 0 [1/3]  pass 1 38%  train 2.0000")  # 384 of 16 x 64 samples
    # an epoch that is one pass, or a pass of unknown size, says nothing of it
    assert format_epoch_line(outcome, 3, 0.5, position={"steps": 10}).startswith(
        "epoch 0 [1/3]  train 2.0000"
    )
    assert "pass" not in format_epoch_line(outcome, 3, 0.5)
