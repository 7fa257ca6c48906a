"""The per-epoch rules: batch-count plans, sample-weighted losses and lamp's loop state, as tables.

Every expected value below is worked out by hand (and chosen to be exact in binary floating point
where the test compares with ==).
"""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epochal.coordinator.rules.batches import (
    BatchCounts,
    EpochPlan,
    PolicyViolation,
    format_ranks,
    plan_epoch,
)
from epochal.coordinator.rules.loop import LoopState
from epochal.coordinator.rules.outcome import EpochOutcome
from epochal.coordinator.rules.sums import (
    WIRE_INT_MAX,
    LossSums,
    aggregate,
    aggregate_metrics,
    count_total,
)
from epochal.protocol import Go

PROPERTY = settings(max_examples=300, deadline=None)
POLICIES = ["error", "truncate"]


def counts(*pairs: tuple[int, int | None]) -> dict[int, BatchCounts]:
    """Rank i announces pairs[i] as (train, valid)."""
    return {rank: BatchCounts(train=t, valid=v) for rank, (t, v) in enumerate(pairs)}


def violation(table: dict[int, BatchCounts], policy: str) -> str:
    with pytest.raises(PolicyViolation) as info:
        plan_epoch(table, policy)  # type: ignore[arg-type]
    return str(info.value)


def parse_ranks(text: str) -> list[int]:
    """The inverse of format_ranks: "ranks 0-2,5" -> [0, 1, 2, 5]."""
    word, _, spans = text.partition(" ")
    out: list[int] = []
    for span in spans.split(","):
        lo, _, hi = span.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    assert word == ("ranks" if len(out) > 1 else "rank"), text
    return out


# ----------------------------------------------------------------------------- format_ranks


@pytest.mark.parametrize(
    ("ranks", "expected"),
    [
        ([3], "rank 3"),
        ([0], "rank 0"),
        ([0, 1], "ranks 0-1"),
        ([0, 2], "ranks 0,2"),
        ([0, 1, 2, 5], "ranks 0-2,5"),
        ([5, 2, 1, 0], "ranks 0-2,5"),
        ([1, 3, 4, 5, 9, 10], "ranks 1,3-5,9-10"),
        (range(1000), "ranks 0-999"),
        ({7, 8}, "ranks 7-8"),
    ],
)
def test_format_ranks(ranks: list[int], expected: str):
    assert format_ranks(ranks) == expected


@PROPERTY
@given(st.sets(st.integers(0, 2000), min_size=1, max_size=60))
def test_format_ranks_names_exactly_the_given_ranks(ranks: set[int]):
    text = format_ranks(ranks)
    assert parse_ranks(text) == sorted(ranks)
    # a run of consecutive ranks is one span, so the text never grows with the rank count alone
    assert text.count(",") + 1 == sum(1 for r in ranks if r - 1 not in ranks)


# ----------------------------------------------------------------------------- plan_epoch


@pytest.mark.parametrize("policy", POLICIES)
def test_equal_counts_run_as_announced(policy: str):
    assert plan_epoch(counts((48, 12), (48, 12), (48, 12)), policy) == EpochPlan(  # type: ignore[arg-type]
        train_batches=48, valid_batches=12
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_a_single_rank_runs_its_own_counts(policy: str):
    assert plan_epoch(counts((5, None)), policy) == EpochPlan(5, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", POLICIES)
def test_no_validation_anywhere_plans_zero_validation_batches(policy: str):
    plan = plan_epoch(counts((7, None), (7, None)), policy)  # type: ignore[arg-type]
    assert plan == EpochPlan(train_batches=7, valid_batches=0)


def test_unequal_train_counts_under_error_name_every_rank_and_the_fix():
    message = violation(counts((48, None), (48, None), (47, None)), "error")
    assert message.startswith("rank 2 has 47, ranks 0-1 have 48 train batches: ")
    assert "make every rank's loader yield the same number of batches" in message
    assert "--batch-policy truncate" in message


def test_unequal_counts_list_the_minority_first():
    # groups are ordered by size, then by lowest rank
    message = violation(counts((10, None), (11, None), (11, None), (12, None), (11, None)), "error")
    assert message.startswith("rank 0 has 10, rank 3 has 12, ranks 1-2,4 have 11 train batches")


def test_unequal_validation_counts_under_error_are_named_as_validation():
    message = violation(counts((4, 6), (4, 5), (4, 6)), "error")
    assert message.startswith("rank 1 has 5, ranks 0,2 have 6 validation batches: ")


def test_when_both_differ_the_train_counts_are_named():
    message = violation(counts((4, 6), (3, 5)), "error")
    assert message.startswith("rank 0 has 4, rank 1 has 3 train batches")


def test_truncate_runs_the_minimum_of_each():
    plan = plan_epoch(counts((48, 9), (47, 10), (50, 11)), "truncate")
    assert plan == EpochPlan(train_batches=47, valid_batches=9)


@pytest.mark.parametrize("policy", POLICIES)
def test_an_empty_train_loader_is_refused_under_every_policy(policy: str):
    message = violation(counts((5, None), (0, None), (5, None)), policy)
    assert message.startswith("rank 1 has an empty train loader (0 batches)")
    assert "give every rank at least one batch" in message


@pytest.mark.parametrize("policy", POLICIES)
def test_several_empty_train_loaders_are_named_together(policy: str):
    message = violation(counts((0, 1), (0, 1), (5, 1)), policy)
    assert message.startswith("ranks 0-1 have an empty train loader (0 batches)")


@pytest.mark.parametrize("policy", POLICIES)
def test_an_empty_validation_loader_is_refused(policy: str):
    message = violation(counts((5, 2), (5, 0)), policy)
    assert message.startswith("rank 1 has an empty validation loader (0 batches)")
    assert "or pass no validation loader" in message


@pytest.mark.parametrize("policy", POLICIES)
def test_some_ranks_without_a_validation_loader_are_refused(policy: str):
    message = violation(counts((5, 2), (5, None), (5, 2)), policy)
    assert message.startswith("rank 1 has no validation loader but ranks 0,2 do: ")
    assert "give every rank a validation loader, or none" in message


@pytest.mark.parametrize("policy", POLICIES)
def test_most_ranks_without_a_validation_loader_are_refused(policy: str):
    message = violation(counts((5, None), (5, None), (5, 2)), policy)
    assert message.startswith("ranks 0-1 have no validation loader but rank 2 does: ")


_BY_COUNT_PART = re.compile(r"(ranks? [\d,-]+) (?:has|have) (\d+)")


@PROPERTY
@given(st.dictionaries(st.integers(0, 300), st.integers(1, 6), min_size=1, max_size=25))
def test_error_policy_runs_equal_counts_and_names_every_rank_of_unequal_ones(
    train: dict[int, int],
):
    table = {rank: BatchCounts(train=n, valid=None) for rank, n in train.items()}
    if len(set(train.values())) == 1:
        assert plan_epoch(table, "error") == EpochPlan(next(iter(train.values())), 0)
        return
    message = violation(table, "error")
    head = message.split(" train batches: ")[0]
    named: dict[int, int] = {}
    for ranks, n in _BY_COUNT_PART.findall(head):
        for rank in parse_ranks(ranks):
            assert rank not in named, f"rank {rank} named twice in {head!r}"
            named[rank] = int(n)
    assert named == train


@PROPERTY
@given(
    st.lists(st.integers(1, 1000), min_size=1, max_size=16),
    st.lists(st.integers(1, 1000), min_size=16, max_size=16) | st.none(),
)
def test_truncate_plans_the_minimum_and_never_more_than_any_rank_holds(
    train: list[int], valid: list[int] | None
):
    table = {
        rank: BatchCounts(train=t, valid=None if valid is None else valid[rank])
        for rank, t in enumerate(train)
    }
    plan = plan_epoch(table, "truncate")
    assert plan.train_batches == min(train)
    expected_valid = 0 if valid is None else min(valid[: len(train)])
    assert plan.valid_batches == expected_valid


# ----------------------------------------------------------------------------- aggregate


def test_losses_are_weighted_by_samples_not_averaged_over_ranks():
    reports = {
        0: LossSums(train_sum=10.0, train_count=4, valid_sum=3.0, valid_count=2),
        1: LossSums(train_sum=2.0, train_count=1, valid_sum=9.0, valid_count=6),
    }
    # (10 + 2) / (4 + 1) = 2.4, not (2.5 + 2.0) / 2 = 2.25; validation (3 + 9) / (2 + 6) = 1.5
    train, valid = aggregate(reports)
    assert train == pytest.approx(2.4, rel=1e-15)
    assert valid == 1.5


def test_three_ranks_with_different_counts():
    reports = {
        0: LossSums(train_sum=1.0, train_count=1, valid_sum=0.0, valid_count=0),
        1: LossSums(train_sum=6.0, train_count=3, valid_sum=4.0, valid_count=1),
        2: LossSums(train_sum=9.0, train_count=4, valid_sum=2.0, valid_count=3),
    }
    # train (1 + 6 + 9) / 8 = 2.0; validation (0 + 4 + 2) / (0 + 1 + 3) = 1.5
    assert aggregate(reports) == (2.0, 1.5)


def test_validation_is_none_when_no_rank_validated():
    reports = {
        0: LossSums(train_sum=3.0, train_count=2, valid_sum=0.0, valid_count=0),
        1: LossSums(train_sum=1.0, train_count=2, valid_sum=0.0, valid_count=0),
    }
    assert aggregate(reports) == (1.0, None)


def test_aggregate_sums_exactly():
    # fsum: a naive running sum of these gives 0.0
    reports = {
        0: LossSums(train_sum=1e16, train_count=1, valid_sum=0.0, valid_count=0),
        1: LossSums(train_sum=1.0, train_count=1, valid_sum=0.0, valid_count=0),
        2: LossSums(train_sum=-1e16, train_count=2, valid_sum=0.0, valid_count=0),
    }
    assert aggregate(reports) == (0.25, None)


@pytest.mark.parametrize(
    ("train_sum", "valid_sum"),
    [(math.nan, 0.0), (math.inf, 0.0), (-math.inf, 0.0), (1.0, math.nan), (1.0, math.inf)],
)
def test_a_non_finite_loss_is_a_violation_naming_the_rank(train_sum: float, valid_sum: float):
    reports = {
        0: LossSums(train_sum=1.0, train_count=1, valid_sum=1.0, valid_count=1),
        3: LossSums(train_sum=train_sum, train_count=1, valid_sum=valid_sum, valid_count=1),
    }
    with pytest.raises(PolicyViolation) as info:
        aggregate(reports)
    message = str(info.value)
    assert message.startswith("rank 3 reported a non-finite loss")
    assert "lower the learning rate" in message


def test_zero_training_samples_in_total_is_a_violation():
    reports = {0: LossSums(train_sum=0.0, train_count=0, valid_sum=0.0, valid_count=0)}
    with pytest.raises(PolicyViolation, match="0 training samples in total"):
        aggregate(reports)


@PROPERTY
@given(
    st.lists(
        st.tuples(st.integers(1, 50), st.floats(0, 10), st.integers(0, 50), st.floats(0, 10)),
        min_size=1,
        max_size=8,
    )
)
def test_aggregate_equals_the_mean_over_all_samples(ranks: list[tuple[int, float, int, float]]):
    # each rank's samples all have the same loss; the global loss is the mean over every sample
    reports = {
        r: LossSums(train_sum=tn * tl, train_count=tn, valid_sum=vn * vl, valid_count=vn)
        for r, (tn, tl, vn, vl) in enumerate(ranks)
    }
    train, valid = aggregate(reports)
    train_samples = [tl for tn, tl, _, _ in ranks for _ in range(tn)]
    valid_samples = [vl for _, _, vn, vl in ranks for _ in range(vn)]
    assert train == pytest.approx(math.fsum(train_samples) / len(train_samples), abs=1e-12)
    if valid_samples:
        assert valid == pytest.approx(math.fsum(valid_samples) / len(valid_samples), abs=1e-12)
    else:
        assert valid is None


# ----------------------------------------------------------------------------- LoopState


def run(state: LoopState, losses: list[tuple[float, float | None]], *, validates: bool):
    return [
        state.update(epoch, train, valid, validates=validates)
        for epoch, (train, valid) in enumerate(losses)
    ]


def summary(outcomes: list[EpochOutcome]) -> list[tuple[float | None, int | None, bool, bool]]:
    return [(o.smoothed_loss, o.best_epoch, o.is_best, o.stop) for o in outcomes]


def test_without_smoothing_the_lowest_validation_loss_wins_and_ties_keep_the_earlier():
    state = LoopState(epochs=4, smoothing=1.0)
    outcomes = run(state, [(9.0, 3.0), (9.0, 1.0), (9.0, 1.0), (9.0, 2.0)], validates=True)
    assert summary(outcomes) == [
        (3.0, 0, True, False),
        (1.0, 1, True, False),
        (1.0, 1, False, False),  # a tie is not an improvement
        (2.0, 1, False, True),
    ]
    assert (state.best_epoch, state.best_loss) == (1, 1.0)


def test_smoothing_half_follows_lamps_formula_seeded_with_the_first_value():
    state = LoopState(epochs=5, smoothing=0.5)
    outcomes = run(
        state, [(0.0, 4.0), (0.0, 2.0), (0.0, 3.0), (0.0, 1.0), (0.0, 5.0)], validates=True
    )
    # s0 = 4; s1 = .5*2 + .5*4 = 3; s2 = .5*3 + .5*3 = 3 (tie); s3 = .5*1 + .5*3 = 2;
    # s4 = .5*5 + .5*2 = 3.5
    assert summary(outcomes) == [
        (4.0, 0, True, False),
        (3.0, 1, True, False),
        (3.0, 1, False, False),
        (2.0, 3, True, False),
        (3.5, 3, False, True),
    ]
    assert [o.best_loss for o in outcomes] == [4.0, 3.0, 3.0, 2.0, 2.0]


def test_smoothing_can_move_the_best_epoch_away_from_the_raw_minimum():
    state = LoopState(epochs=3, smoothing=0.25)
    outcomes = run(state, [(0.0, 8.0), (0.0, 0.0), (0.0, 4.0)], validates=True)
    # s0 = 8; s1 = .25*0 + .75*8 = 6; s2 = .25*4 + .75*6 = 5.5: raw minimum is epoch 1, smoothed 2
    assert [o.smoothed_loss for o in outcomes] == [8.0, 6.0, 5.5]
    assert state.best_epoch == 2


def test_the_outcome_carries_the_raw_losses():
    outcome = LoopState(epochs=2, smoothing=0.5).update(0, 0.75, 0.5, validates=True)
    assert (outcome.epoch, outcome.train_loss, outcome.valid_loss) == (0, 0.75, 0.5)


def test_an_epoch_without_validation_keeps_the_smoothing_state_and_the_best():
    state = LoopState(epochs=4, smoothing=0.5)
    outcomes = run(state, [(5.0, 2.0), (0.5, None), (5.0, 1.0), (5.0, None)], validates=True)
    # epoch 1 leaves s = 2 (not reset, not fed the train loss); s2 = .5*1 + .5*2 = 1.5
    assert summary(outcomes) == [
        (2.0, 0, True, False),
        (None, 0, False, False),
        (1.5, 2, True, False),
        (None, 2, False, True),
    ]
    assert outcomes[1].best_loss == 2.0
    assert state.smoothed == 1.5


def test_without_validation_the_train_loss_is_monitored():
    state = LoopState(epochs=3, smoothing=1.0)
    outcomes = run(state, [(3.0, None), (1.0, None), (2.0, None)], validates=False)
    assert summary(outcomes) == [
        (3.0, 0, True, False),
        (1.0, 1, True, False),
        (2.0, 1, False, True),
    ]


def test_without_validation_a_reported_validation_loss_is_ignored():
    state = LoopState(epochs=2, smoothing=1.0)
    outcomes = run(state, [(3.0, 0.5), (1.0, 9.0)], validates=False)
    assert [o.smoothed_loss for o in outcomes] == [3.0, 1.0]
    assert state.best_epoch == 1


def test_no_best_epoch_until_something_is_monitored():
    state = LoopState(epochs=3, smoothing=0.5)
    first = state.update(0, 1.0, None, validates=True)
    assert (first.smoothed_loss, first.best_epoch, first.best_loss, first.is_best) == (
        None,
        None,
        None,
        False,
    )
    second = state.update(1, 1.0, 7.0, validates=True)
    assert (second.smoothed_loss, second.best_epoch, second.is_best) == (7.0, 1, True)


@pytest.mark.parametrize("epochs", [1, 2, 7])
def test_stop_is_set_on_the_last_epoch_only(epochs: int):
    state = LoopState(epochs=epochs)
    stops = [state.update(e, 1.0, None, validates=False).stop for e in range(epochs)]
    assert stops == [False] * (epochs - 1) + [True]


def test_a_resumed_loop_stops_at_the_configured_last_epoch():
    state = LoopState(epochs=5)
    assert [state.update(e, 1.0, None, validates=False).stop for e in (3, 4)] == [False, True]


def test_history_records_every_outcome_in_order():
    state = LoopState(epochs=3, smoothing=0.5)
    outcomes = run(state, [(1.0, 2.0), (1.0, None), (1.0, 1.0)], validates=True)
    assert state.history == outcomes
    assert [o.epoch for o in state.history] == [0, 1, 2]


@PROPERTY
@given(st.lists(st.integers(0, 20).map(float), min_size=1, max_size=30))
def test_without_smoothing_the_best_epoch_is_the_first_lowest(losses: list[float]):
    state = LoopState(epochs=len(losses), smoothing=1.0)
    outcomes = [state.update(e, 0.0, v, validates=True) for e, v in enumerate(losses)]
    assert [o.smoothed_loss for o in outcomes] == losses
    assert state.best_epoch == losses.index(min(losses))
    assert state.best_loss == min(losses)
    # is_best exactly when the loss beats every earlier one
    assert [o.is_best for o in outcomes] == [
        e == 0 or v < min(losses[:e]) for e, v in enumerate(losses)
    ]
    assert [o.stop for o in outcomes] == [e == len(losses) - 1 for e in range(len(losses))]


@PROPERTY
@given(
    st.floats(0.01, 1.0),
    st.lists(st.floats(0, 100) | st.none(), min_size=1, max_size=30),
)
def test_smoothing_matches_a_reference_implementation(a: float, losses: list[float | None]):
    state = LoopState(epochs=len(losses), smoothing=a)
    s: float | None = None
    best: tuple[int, float] | None = None
    for epoch, v in enumerate(losses):
        outcome = state.update(epoch, 1.0, v, validates=True)
        if v is not None:
            s = v if s is None else a * v + (1 - a) * s
            if best is None or s < best[1]:
                best = (epoch, s)
        assert outcome.smoothed_loss == (None if v is None else s)
        assert (outcome.best_epoch, outcome.best_loss) == (best or (None, None))


def test_loss_sums_that_overflow_together_name_the_ranks():
    # each sum is finite, their total is not: fsum raised OverflowError and killed the coordinator
    reports = {
        0: LossSums(train_sum=1.5e308, train_count=1, valid_sum=0.0, valid_count=0),
        1: LossSums(train_sum=1.5e308, train_count=1, valid_sum=0.0, valid_count=0),
        2: LossSums(train_sum=1.0, train_count=1, valid_sum=0.0, valid_count=0),
    }
    with pytest.raises(PolicyViolation, match=r"training loss sums of ranks 0-1 .*diverged"):
        aggregate(reports)


def test_validation_sums_that_overflow_are_a_violation_too():
    reports = {
        0: LossSums(train_sum=1.0, train_count=1, valid_sum=-1.5e308, valid_count=1),
        1: LossSums(train_sum=1.0, train_count=1, valid_sum=-1.5e308, valid_count=1),
    }
    with pytest.raises(PolicyViolation, match="validation loss sums of ranks 0-1"):
        aggregate(reports)


MAX = WIRE_INT_MAX


def sums(train: int, valid: int = 0, train_metric: int | None = None) -> LossSums:
    metrics = {} if train_metric is None else {"hits": (1.0, train_metric)}
    return LossSums(1.0, train, 0.0, valid, train_metrics=metrics)


@pytest.mark.parametrize(
    ("reports", "named"),
    [
        # every count fits the wire (the codec accepts up to 2**64-1), their sum does not
        ({0: sums(MAX), 1: sums(1)}, "training sample counts of ranks 0-1 (rank 0 " + str(MAX)),
        (
            {0: sums(1, 5), 1: sums(1, MAX), 2: sums(1, MAX)},
            "validation sample counts of ranks 1-2",
        ),
        # the fewest ranks whose counts alone overflow, not every rank that reported
        (
            {r: sums(2**62) for r in range(4)} | {4: sums(2**62 + 1)},
            "training sample counts of ranks 0-2,4",
        ),
        ({0: sums(2**63), 1: sums(2**63), 2: sums(3)}, "training sample counts of ranks 0-1 "),
        (
            {0: sums(1, train_metric=MAX), 1: sums(1, train_metric=MAX)},
            "training metric 'hits' sample counts of ranks 0-1",
        ),
    ],
)
def test_counts_that_add_up_past_the_wire_abort_naming_the_ranks(reports, named: str):
    with pytest.raises(PolicyViolation) as info:
        aggregate(reports)
        aggregate_metrics(reports)
    assert named in str(info.value)
    assert "more than a message can carry" in str(info.value)


@pytest.mark.parametrize("counts", [{0: MAX}, {0: MAX - 1, 1: 1}, {0: 0, 1: 0}, {}])
def test_counts_that_fit_the_wire_are_summed(counts: dict[int, int]):
    assert count_total(counts, "training sample") == sum(counts.values())


def test_an_epochs_journal_line_and_its_decision_say_what_its_outcome_says():
    import json

    from epochal.coordinator.rules.batches import EpochPlan
    from epochal.coordinator.rules.loop import LoopState
    from epochal.coordinator.rules.outcome import EpochOutcome

    loop = LoopState(epochs=3)
    loop.update(0, 2.0, 1.5, validates=True)
    outcome = loop.update(1, 1.0, 1.0, validates=True)
    record = outcome.record(validates=True, checkpoint=True, plan=EpochPlan(4, 2), seconds=1.25)
    assert record["kind"] == "epoch" and record["train_batches"] == 4 and record["seconds"] == 1.25
    assert EpochOutcome.from_record(json.loads(json.dumps(record))) == outcome
    go = Go(epoch=2, train_batches=4, valid_batches=2, lr_factor=1.0)
    decision = outcome.decision(checkpoint=True, go=go)
    assert (decision.epoch, decision.valid_loss, decision.best_epoch) == (1, 1.0, 1)
    assert decision.is_best and decision.checkpoint and not decision.stop
    assert decision.go == go  # the run goes on: the next epoch's go rides along
