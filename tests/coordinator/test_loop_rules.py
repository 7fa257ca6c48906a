"""lamp's epoch-loop rules in LoopState, one table per rule, plus the replay property.

Each table lists, per epoch, what goes in (train loss, validation loss or None) and what must come
out. The service passes ``valid_loss=None`` on epochs it did not validate (validation frequency)
with ``validates=True`` (the run has validation data), so that is how those epochs appear here.
Expected values are worked out by hand and exact in binary floating point unless compared with
pytest.approx.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epochal.coordinator.config import CoordinatorConfig
from epochal.coordinator.rules.loop import LoopState
from epochal.coordinator.rules.outcome import EpochOutcome
from epochal.coordinator.rules.schedule import parse_schedule

PROPERTY = settings(max_examples=100, deadline=None)

# When a hypothesis test fails, its pytest plugin imports libcst, which trips a DeprecationWarning
# from mypy_extensions; with warnings as errors that turns one failure into an INTERNALERROR that
# ends the whole session. Not ours to fix here, so it is ignored for this module.
pytestmark = pytest.mark.filterwarnings(
    "ignore:mypy_extensions.TypedDict is deprecated:DeprecationWarning"
)

Row = tuple[float, float | None]


def feed(state: LoopState, rows: list[Row], *, validates: bool = True) -> list[EpochOutcome]:
    return [
        state.update(epoch, train, valid, validates=validates)
        for epoch, (train, valid) in enumerate(rows)
    ]


def column(outcomes: list[EpochOutcome], name: str) -> list[Any]:
    return [getattr(o, name) for o in outcomes]


# ----------------------------------------------------------------------------- smoothing


def test_smoothing_is_carried_across_unvalidated_epochs():
    # validation every 2nd epoch: the service reports None on epochs 1, 3, 5
    state = LoopState(epochs=6, smoothing=0.5)
    outcomes = feed(
        state, [(9.0, 4.0), (0.1, None), (9.0, 2.0), (0.1, None), (9.0, 5.0), (0.1, None)]
    )
    # s0 = 4; s2 = .5*2 + .5*4 = 3 (lamp would have reset to 2); s4 = .5*5 + .5*3 = 4
    assert column(outcomes, "smoothed_loss") == [4.0, None, 3.0, None, 4.0, None]
    assert column(outcomes, "best_epoch") == [0, 0, 2, 2, 2, 2]
    assert column(outcomes, "best_loss") == [4.0, 4.0, 3.0, 3.0, 3.0, 3.0]
    assert column(outcomes, "is_best") == [True, False, True, False, False, False]
    assert column(outcomes, "stop") == [False] * 5 + [True]
    assert (state.smoothed, state.best_epoch, state.best_loss) == (4.0, 2, 3.0)


def test_an_unvalidated_epoch_changes_no_state_at_all():
    state = LoopState(epochs=10, smoothing=0.25, patience=3)
    feed(state, [(1.0, 8.0), (1.0, 9.0)])
    before = (state.smoothed, state.best_epoch, state.best_loss, state.stale, state.lr_factor)
    outcome = state.update(2, 0.001, None, validates=True)
    after = (state.smoothed, state.best_epoch, state.best_loss, state.stale, state.lr_factor)
    assert after == before
    assert (outcome.smoothed_loss, outcome.is_best, outcome.valid_loss) == (None, False, None)
    assert (outcome.best_epoch, outcome.best_loss) == (0, 8.0)


@pytest.mark.parametrize(
    ("a", "losses", "smoothed"),
    [
        (1.0, [4.0, 2.0, 8.0], [4.0, 2.0, 8.0]),
        (0.5, [4.0, 2.0, 8.0], [4.0, 3.0, 5.5]),
        (0.25, [8.0, 0.0, 4.0], [8.0, 6.0, 5.5]),
        (0.75, [4.0, 0.0, 8.0], [4.0, 1.0, 6.25]),
    ],
)
def test_smoothing_is_a_times_raw_plus_one_minus_a_times_previous(
    a: float, losses: list[float], smoothed: list[float]
):
    outcomes = feed(LoopState(epochs=3, smoothing=a), [(0.0, v) for v in losses])
    assert column(outcomes, "smoothed_loss") == smoothed


# ----------------------------------------------------------------------------- best epoch


@pytest.mark.parametrize(
    ("a", "losses", "best_epochs", "is_best"),
    [
        # a tie is not an improvement: the earlier epoch stays the best
        (1.0, [2.0, 1.0, 1.0, 3.0], [0, 1, 1, 1], [True, True, False, False]),
        # smoothed 4, 3, 3.5, 1.75: the raw value 2 at epoch 1 is not what counts
        (0.5, [4.0, 2.0, 4.0, 0.0], [0, 1, 1, 3], [True, True, False, True]),
        # smoothed 4, 3, 3 (a tie of smoothed values): epoch 1 stays
        (0.5, [4.0, 2.0, 3.0, 3.0], [0, 1, 1, 1], [True, True, False, False]),
    ],
)
def test_the_best_epoch_has_the_strictly_lowest_smoothed_loss(
    a: float, losses: list[float], best_epochs: list[int], is_best: list[bool]
):
    outcomes = feed(LoopState(epochs=4, smoothing=a), [(0.0, v) for v in losses])
    assert column(outcomes, "best_epoch") == best_epochs
    assert column(outcomes, "is_best") == is_best


def test_best_from_excludes_early_epochs_but_they_still_feed_the_smoothing():
    state = LoopState(epochs=5, smoothing=0.5, best_from=2)
    outcomes = feed(state, [(0.0, 0.0), (0.0, 8.0), (0.0, 8.0), (0.0, 2.0), (0.0, 1.0)])
    # s = 0, 4, 6, 4, 2.5: epoch 0's 0 would be the best, but epochs 0 and 1 are excluded
    assert column(outcomes, "smoothed_loss") == [0.0, 4.0, 6.0, 4.0, 2.5]
    assert column(outcomes, "best_epoch") == [None, None, 2, 3, 4]
    assert column(outcomes, "best_loss") == [None, None, 6.0, 4.0, 2.5]
    assert column(outcomes, "is_best") == [False, False, True, True, True]


def test_best_from_starts_a_fresh_best_even_when_it_is_worse_than_before():
    state = LoopState(epochs=4, smoothing=1.0, best_from=1)
    outcomes = feed(state, [(0.0, 1.0), (0.0, 5.0), (0.0, 6.0), (0.0, 4.0)])
    assert column(outcomes, "best_epoch") == [None, 1, 1, 3]


def test_best_from_after_the_last_epoch_never_names_a_best():
    state = LoopState(epochs=3, best_from=3)
    outcomes = feed(state, [(0.0, 3.0), (0.0, 2.0), (0.0, 1.0)])
    assert column(outcomes, "best_epoch") == [None, None, None]
    assert not any(column(outcomes, "is_best"))


def test_best_from_counts_epochs_not_validations():
    # validation every 3rd epoch: epoch 3 is the first one >= best_from=2 with a loss
    state = LoopState(epochs=7, smoothing=1.0, best_from=2)
    rows: list[Row] = [(0.0, 1.0), (0.0, None), (0.0, None), (0.0, 5.0), (0.0, None)]
    outcomes = feed(state, [*rows, (0.0, None), (0.0, 4.0)])
    assert column(outcomes, "best_epoch") == [None, None, None, 3, 3, 3, 6]


# ----------------------------------------------------------------------------- learning-rate factor


def test_each_outcome_carries_the_factor_it_ran_at_and_the_next_one():
    schedule = parse_schedule("step:every=1,gamma=0.5", 4)
    outcomes = feed(LoopState(epochs=4, schedule=schedule), [(1.0, 1.0)] * 4)
    assert column(outcomes, "lr_factor") == [1.0, 0.5, 0.25, 0.125]
    assert column(outcomes, "next_lr_factor") == [0.5, 0.25, 0.125, 0.0625]


def test_without_a_schedule_the_factor_stays_one():
    outcomes = feed(LoopState(epochs=3), [(1.0, 1.0)] * 3)
    assert column(outcomes, "lr_factor") == [1.0, 1.0, 1.0]
    assert column(outcomes, "next_lr_factor") == [1.0, 1.0, 1.0]


def test_a_linear_schedule_ending_at_three_stops_after_epoch_two():
    schedule = parse_schedule("linear:end=3", 10)
    state = LoopState(epochs=10, schedule=schedule)
    outcomes = feed(state, [(1.0, 1.0)] * 3)
    assert column(outcomes, "lr_factor") == pytest.approx([1.0, 2 / 3, 1 / 3])
    assert column(outcomes, "next_lr_factor") == pytest.approx([2 / 3, 1 / 3, 0.0])
    assert column(outcomes, "stop") == [False, False, True]
    assert column(outcomes, "stop_reason") == [None, None, "lr_factor"]
    assert state.lr_factor <= 0


@pytest.mark.parametrize(
    ("spec", "epochs", "stop_after", "reason"),
    [
        ("step:every=1,gamma=0", 10, 0, "lr_factor"),
        ("step:every=3,gamma=0", 10, 2, "lr_factor"),  # epoch 3 would run at 0 ** 1
        ("exponential:gamma=0", 10, 0, "lr_factor"),
        ("linear:end=2.5", 10, 2, "lr_factor"),  # epoch 3 would run at 1 - 3/2.5 < 0
        ("linear:end=3", 3, 2, "epochs"),  # the last epoch and a zero factor: "epochs" wins
        ("linear:end=5", 3, 2, "epochs"),
        ("exponential:gamma=0.5", 4, 3, "epochs"),
        ("cosine:min=0", 4, 3, "epochs"),  # cosine reaches min=0 only after the last epoch
        ("plateau:patience=1,factor=0", 10, 2, "lr_factor"),  # losses are flat: 2 bad epochs
    ],
)
def test_the_run_stops_where_the_schedule_or_the_epoch_count_says(
    spec: str, epochs: int, stop_after: int, reason: str
):
    state = LoopState(epochs=epochs, schedule=parse_schedule(spec, epochs))
    outcomes = []
    for epoch in range(epochs):
        outcomes.append(state.update(epoch, 1.0, 1.0, validates=True))
        if outcomes[-1].stop:
            break
    assert len(outcomes) == stop_after + 1
    assert outcomes[-1].stop_reason == reason
    assert all(o.stop_reason is None and not o.stop for o in outcomes[:-1])


def test_a_zero_factor_stops_even_on_an_unvalidated_epoch():
    state = LoopState(epochs=10, schedule=parse_schedule("linear:end=2", 10))
    outcomes = feed(state, [(1.0, 1.0), (1.0, None)])
    assert column(outcomes, "stop_reason") == [None, "lr_factor"]


def test_plateau_is_driven_by_the_smoothed_loss_and_sees_no_loss_on_unvalidated_epochs():
    schedule = parse_schedule("plateau:patience=0,factor=0.5,threshold=0", 10)
    state = LoopState(epochs=10, smoothing=0.5, schedule=schedule)
    rows: list[Row] = [(0.0, 8.0), (0.0, 2.0), (0.0, 4.0), (0.0, None), (0.0, 8.0)]
    outcomes = feed(state, [*rows, (0.0, 2.0), (0.0, 8.0)])
    # smoothed: 8, 5, 4.5, -, 6.25, 4.125, 6.0625. The raw 4 at epoch 2 is worse than the raw 2
    # before it, but the smoothed 4.5 improves on 5: no reduction there. Epoch 3 has no loss and
    # does not count. 6.25 and 6.0625 are worse than the best smoothed loss: halve each time.
    assert column(outcomes, "smoothed_loss") == [8.0, 5.0, 4.5, None, 6.25, 4.125, 6.0625]
    assert column(outcomes, "lr_factor") == [1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.5]
    assert column(outcomes, "next_lr_factor") == [1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.25]
    assert state.schedule_state == {"best": 4.125, "bad": 0}
    assert not any(column(outcomes, "stop"))


def test_plateau_without_validation_watches_the_train_loss():
    schedule = parse_schedule("plateau:patience=0,factor=0.5,threshold=0", 10)
    state = LoopState(epochs=10, schedule=schedule)
    outcomes = feed(state, [(3.0, None), (2.0, None), (2.5, None)], validates=False)
    assert column(outcomes, "next_lr_factor") == [1.0, 1.0, 0.5]


@pytest.mark.parametrize("epochs", [2, 5, 9])
def test_the_next_factor_is_the_one_the_next_epoch_runs_at(epochs: int):
    for spec in ("cosine:min=0.1", "exponential:gamma=0.5", "plateau:patience=0,threshold=0"):
        state = LoopState(epochs=epochs, smoothing=0.5, schedule=parse_schedule(spec, epochs))
        outcomes = feed(state, [(1.0, float(e % 3)) for e in range(epochs)])
        assert outcomes[0].lr_factor == 1.0
        for before, after in itertools.pairwise(outcomes):
            assert after.lr_factor == before.next_lr_factor, spec


# ----------------------------------------------------------------------------- patience

# patience=2, min_delta=0.5, no smoothing; an improvement must go below (best so far - 0.5)
PATIENCE_TABLE: list[tuple[float | None, int, bool, str | None]] = [
    # validation loss, stale after the epoch, is_best, stop_reason
    (10.0, 0, True, None),
    (9.6, 1, True, None),  # lower, so the new best, but not by more than 0.5: stale
    (None, 1, False, None),  # unvalidated: the count does not move
    (9.2, 2, True, None),  # 0.4 below the best 9.6: stale again
    (8.5, 0, True, None),  # 0.7 below 9.2: improved, count back to 0
    (9.0, 1, False, None),
    (9.0, 2, False, None),
    (None, 2, False, None),  # no stop on an unvalidated epoch
    (9.0, 3, False, "patience"),  # the third monitored epoch in a row without improvement
]


def test_patience_table():
    state = LoopState(epochs=20, patience=2, min_delta=0.5)
    for epoch, (valid, stale, is_best, reason) in enumerate(PATIENCE_TABLE):
        outcome = state.update(epoch, 0.0, valid, validates=True)
        assert (state.stale, outcome.is_best, outcome.stop_reason) == (stale, is_best, reason), (
            epoch
        )
        assert outcome.stop == (reason is not None)


@pytest.mark.parametrize(
    ("patience", "stop_after"),
    [(0, 1), (1, 2), (2, 3), (4, 5)],
)
def test_patience_stops_once_more_than_p_monitored_epochs_fail_to_improve(
    patience: int, stop_after: int
):
    state = LoopState(epochs=50, patience=patience)
    outcomes = []
    for epoch in range(50):
        outcomes.append(state.update(epoch, 0.0, 1.0, validates=True))
        if outcomes[-1].stop:
            break
    assert len(outcomes) == stop_after + 1
    assert outcomes[-1].stop_reason == "patience"


def test_unvalidated_epochs_between_bad_ones_do_not_count_toward_patience():
    # validation every 3rd epoch, patience 1: epoch 3 is the 1st bad validated epoch, epoch 6 the
    # 2nd; the four unvalidated epochs in between would have stopped the run if they counted
    state = LoopState(epochs=50, patience=1)
    valid = [1.0, None, None, 1.0, None, None, 1.0]
    outcomes = feed(state, [(0.0, v) for v in valid])
    assert column(outcomes, "stop_reason") == [None] * 6 + ["patience"]
    assert state.stale == 2


def test_an_improvement_of_exactly_min_delta_is_not_enough():
    state = LoopState(epochs=10, patience=0, min_delta=0.5)
    outcomes = feed(state, [(0.0, 10.0), (0.0, 9.5)])
    assert column(outcomes, "stop_reason") == [None, "patience"]
    assert outcomes[1].is_best  # it is still the best epoch: min_delta only governs patience


def test_an_improvement_just_over_min_delta_resets_the_count():
    state = LoopState(epochs=10, patience=0, min_delta=0.5)
    outcomes = feed(state, [(0.0, 10.0), (0.0, 9.25), (0.0, 8.5)])
    assert column(outcomes, "stop_reason") == [None, None, None]
    assert state.stale == 0


def test_patience_watches_the_smoothed_loss_not_the_raw_one():
    # raw 8, 2, 4 would be a bad epoch at 4; smoothed (a=.5) 8, 5, 4.5 keeps improving
    state = LoopState(epochs=10, smoothing=0.5, patience=0)
    outcomes = feed(state, [(0.0, 8.0), (0.0, 2.0), (0.0, 4.0)])
    assert column(outcomes, "stop") == [False, False, False]


def test_patience_does_not_count_before_best_from():
    # before best_from there is no best to improve on, so nothing is stale
    state = LoopState(epochs=10, patience=0, best_from=2)
    outcomes = feed(state, [(0.0, 3.0), (0.0, 4.0), (0.0, 5.0), (0.0, 6.0)])
    assert column(outcomes, "stop_reason") == [None, None, None, "patience"]


def test_without_patience_a_long_plateau_runs_to_the_end():
    state = LoopState(epochs=30, patience=None)
    outcomes = feed(state, [(0.0, 1.0)] * 30)
    assert column(outcomes, "stop_reason") == [None] * 29 + ["epochs"]


# ----------------------------------------------------------------------------- the last epoch


@pytest.mark.parametrize("epochs", [1, 2, 6])
def test_the_last_epoch_stops_with_reason_epochs(epochs: int):
    outcomes = feed(LoopState(epochs=epochs), [(1.0, 1.0)] * epochs)
    assert column(outcomes, "stop_reason") == [None] * (epochs - 1) + ["epochs"]
    assert column(outcomes, "stop") == [False] * (epochs - 1) + [True]


def test_the_last_epoch_says_epochs_even_when_patience_would_also_stop():
    state = LoopState(epochs=2, patience=0)
    outcomes = feed(state, [(0.0, 1.0), (0.0, 1.0)])
    assert outcomes[1].stop_reason == "epochs"


def test_a_loop_resumed_at_a_later_epoch_stops_at_the_configured_last():
    state = LoopState(epochs=5)
    outcomes = [state.update(e, 1.0, 1.0, validates=True) for e in (3, 4)]
    assert column(outcomes, "stop_reason") == [None, "epochs"]


# ----------------------------------------------------------------------------- replay

SPECS = [
    None,
    "constant",
    "step:every=2,gamma=0.5",
    "exponential:gamma=0.9",
    "cosine:min=0.1",
    "linear:end=6",
    "plateau:patience=1,factor=0.5,threshold=0.01,min=0.1",
    "plateau:patience=0,factor=0",
]


def loops(draw_args: dict[str, Any]) -> LoopState:
    spec = draw_args["spec"]
    epochs = draw_args["epochs"]
    return LoopState(
        epochs=epochs,
        smoothing=draw_args["smoothing"],
        schedule=None if spec is None else parse_schedule(spec, epochs),
        patience=draw_args["patience"],
        min_delta=draw_args["min_delta"],
        best_from=draw_args["best_from"],
    )


LOOP_ARGS = st.fixed_dictionaries(
    {
        "spec": st.sampled_from(SPECS),
        "epochs": st.integers(1, 15),
        "smoothing": st.sampled_from([1.0, 0.5, 0.3]) | st.floats(0.01, 1.0),
        "patience": st.none() | st.integers(0, 3),
        "min_delta": st.sampled_from([0.0, 0.1, 1.0]),
        "best_from": st.integers(0, 4),
    }
)
ROWS = st.lists(
    st.tuples(st.floats(0, 100), st.floats(0, 100) | st.none()), min_size=15, max_size=15
)


def run_like_the_service(state: LoopState, rows: list[Row], validates: bool) -> list[EpochOutcome]:
    outcomes = []
    for epoch in range(state.epochs):
        train, valid = rows[epoch]
        outcomes.append(state.update(epoch, train, valid, validates=validates))
        if outcomes[-1].stop:
            break
    return outcomes


@PROPERTY
@given(LOOP_ARGS, ROWS, st.booleans())
def test_the_same_updates_give_the_same_state_and_history(
    args: dict[str, Any], rows: list[Row], validates: bool
):
    first, second = loops(args), loops(args)
    # interleaved, so state leaking between instances (a shared schedule, a shared default) shows
    for epoch in range(args["epochs"]):
        train, valid = rows[epoch]
        a = first.update(epoch, train, valid, validates=validates)
        b = second.update(epoch, train, valid, validates=validates)
        assert a == b
        if a.stop:
            break
    assert first == second
    assert first.history == second.history
    assert first.history[-1].stop


@PROPERTY
@given(LOOP_ARGS, ROWS, st.booleans(), st.integers(0, 14))
def test_replaying_a_journal_prefix_then_continuing_equals_the_uninterrupted_loop(
    args: dict[str, Any], rows: list[Row], validates: bool, cut: int
):
    whole = loops(args)
    run_like_the_service(whole, rows, validates)
    # the journal holds each outcome as JSON; a resumed coordinator replays the first `cut + 1`
    journal = [json.loads(json.dumps({**asdict(o), "validates": validates})) for o in whole.history]
    resumed = loops(args)
    kept = journal[: cut + 1]
    for record in kept:
        resumed.update(
            record["epoch"],
            record["train_loss"],
            record["valid_loss"],
            validates=record["validates"],
        )
    assert resumed.history == whole.history[: len(kept)]
    for epoch in range(len(kept), len(whole.history)):
        train, valid = rows[epoch]
        resumed.update(epoch, train, valid, validates=validates)
    assert resumed == whole


def test_the_loops_rules_default_to_what_the_configuration_declares():
    # one declaration per option: a default of the loop's own could drift from the command line's
    config = CoordinatorConfig(world_size=1)
    fresh = LoopState(epochs=config.epochs)
    built = LoopState.from_config(config)
    for name in ("smoothing", "patience", "min_delta", "best_from", "monitor"):
        assert getattr(fresh, name) == getattr(config, name) == getattr(built, name), name
    assert fresh.mode == config.monitor_mode == built.mode
    custom = LoopState.from_config(
        CoordinatorConfig(world_size=1, epochs=7, smoothing=0.5, patience=2, monitor_mode="max")
    )
    assert (custom.epochs, custom.smoothing, custom.patience, custom.mode) == (7, 0.5, 2, "max")
