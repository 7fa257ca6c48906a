"""Learning-rate schedules: parsing every spec, refusing every bad one, and each factor by hand.

The factor tables are worked out by hand; values that are exact in binary floating point are
compared with ==, the rest (cosine, thirds) with pytest.approx.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epochal.coordinator.rules.schedule import SCHEDULE_NAMES, Schedule, parse_schedule
from epochal.errors import ConfigError

PROPERTY = settings(max_examples=150, deadline=None)

# When a hypothesis test fails, its pytest plugin imports libcst, which trips a DeprecationWarning
# from mypy_extensions; with warnings as errors that turns one failure into an INTERNALERROR that
# ends the whole session. Not ours to fix here, so it is ignored for this module.
pytestmark = pytest.mark.filterwarnings(
    "ignore:mypy_extensions.TypedDict is deprecated:DeprecationWarning"
)


def refusal(spec: str, epochs: int = 10) -> str:
    with pytest.raises(ConfigError) as info:
        parse_schedule(spec, epochs)
    return str(info.value)


def factors(schedule: Schedule, monitored: list[float | None]) -> list[float]:
    """Thread the factor and the state through next_factor, as LoopState does."""
    factor, state = 1.0, {}  # every run starts at the initial learning rate
    out = []
    for epoch, value in enumerate(monitored):
        factor = schedule.next_factor(epoch, value, factor, state)
        out.append(factor)
    return out


# ----------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("spec", "params"),
    [
        ("constant", {}),
        ("step", {"every": 10.0, "gamma": 0.1}),
        ("exponential", {"gamma": 0.95}),
        ("cosine", {"min": 0.0}),
        ("plateau", {"patience": 3.0, "factor": 0.5, "threshold": 1e-4, "min": 0.0}),
    ],
)
def test_each_name_alone_takes_its_defaults(spec: str, params: dict[str, float]):
    schedule = parse_schedule(spec, 7)
    assert schedule == Schedule(name=spec, params=params, epochs=7)


def test_every_documented_name_is_known():
    assert set(SCHEDULE_NAMES) == {
        "constant",
        "step",
        "exponential",
        "cosine",
        "linear",
        "plateau",
        "warmup-cosine",
    }


def test_linear_has_no_usable_default_end_and_says_so():
    # the default end=0 is refused on purpose: a linear decay needs the epoch it reaches 0 at
    message = refusal("linear")
    assert "end" in message and "> 0" in message


@pytest.mark.parametrize(
    ("spec", "name", "params"),
    [
        ("step:every=3,gamma=0.5", "step", {"every": 3.0, "gamma": 0.5}),
        ("step:gamma=0.5", "step", {"every": 10.0, "gamma": 0.5}),  # the other keeps its default
        ("exponential:gamma=0.5", "exponential", {"gamma": 0.5}),
        ("cosine:min=0.25", "cosine", {"min": 0.25}),
        ("linear:end=4", "linear", {"end": 4.0}),
        ("linear:end=2.5", "linear", {"end": 2.5}),
        (
            "plateau:patience=5,factor=0.25,threshold=0.01,min=0.125",
            "plateau",
            {"patience": 5.0, "factor": 0.25, "threshold": 0.01, "min": 0.125},
        ),
        (
            "plateau:patience=0",
            "plateau",
            {"patience": 0.0, "factor": 0.5, "threshold": 1e-4, "min": 0.0},
        ),
        # whitespace around the spec and its items, empty items and a trailing colon are fine
        ("  step:every=3 , gamma=0.5 ,", "step", {"every": 3.0, "gamma": 0.5}),
        ("step:every=3,,gamma=0.5", "step", {"every": 3.0, "gamma": 0.5}),
        ("constant:", "constant", {}),
        ("exponential:gamma=1e-1", "exponential", {"gamma": 0.1}),
    ],
)
def test_overrides_replace_only_the_settings_given(spec: str, name: str, params: dict[str, float]):
    schedule = parse_schedule(spec, 12)
    assert (schedule.name, schedule.params, schedule.epochs) == (name, params, 12)


@pytest.mark.parametrize(
    "spec",
    [
        "step:every=1,gamma=0",  # gamma 0 is allowed: it stops the run
        "cosine:min=0",
        "cosine:min=1",
        "plateau:patience=0,factor=0,threshold=0,min=0",
        "linear:end=0.5",
    ],
)
def test_the_edges_of_each_range_are_accepted(spec: str):
    assert parse_schedule(spec, 5).name == spec.partition(":")[0]


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("constant", "constant"),
        ("constant:", "constant"),
        ("step", "step:every=10,gamma=0.1"),
        ("step:gamma=0.5,every=3", "step:every=3,gamma=0.5"),  # sorted, whatever the input order
        ("exponential:gamma=0.5", "exponential:gamma=0.5"),
        ("cosine:min=0.25", "cosine:min=0.25"),
        ("linear:end=4", "linear:end=4"),
        ("plateau", "plateau:factor=0.5,min=0,patience=3,threshold=0.0001"),
    ],
)
def test_spec_is_the_canonical_text_and_parses_back_to_the_same_schedule(spec: str, expected: str):
    schedule = parse_schedule(spec, 9)
    assert schedule.spec == expected
    assert parse_schedule(schedule.spec, 9) == schedule


# A spec reads back to exactly the same settings, however many digits they have.
@pytest.mark.parametrize(
    "spec",
    [
        "exponential:gamma=0.123456789",
        "cosine:min=0.3333333333333333",
        "linear:end=1234567",
        "step:every=1234567,gamma=0.5",
        "plateau:patience=3,factor=0.5,threshold=0.000123456789,min=0",
    ],
)
def test_spec_round_trips_settings_with_many_digits_exactly(spec: str):
    schedule = parse_schedule(spec, 10)
    assert parse_schedule(schedule.spec, 10) == schedule


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("spec", ["warmup", "Step", "", "step2:every=1", ":every=1"])
def test_an_unknown_name_is_refused_listing_every_name_and_an_example(spec: str):
    message = refusal(spec)
    assert f"unknown learning-rate schedule {spec.partition(':')[0]!r}" in message
    for name in SCHEDULE_NAMES:
        assert name in message
    assert "step:every=10,gamma=0.5" in message


@pytest.mark.parametrize(
    ("spec", "item", "allowed"),
    [
        ("step:every=2,foo=1", "'foo=1'", "every, gamma"),
        ("step:every", "'every'", "every, gamma"),  # no '=': not a setting
        ("exponential:every=2", "'every=2'", "gamma"),
        ("constant:gamma=1", "'gamma=1'", "none"),
        ("plateau:patient=2", "'patient=2'", "patience, factor, threshold, min"),
        ("cosine:MIN=0.5", "'MIN=0.5'", "min"),
    ],
)
def test_an_unknown_setting_is_refused_naming_it_and_the_allowed_ones(
    spec: str, item: str, allowed: str
):
    message = refusal(spec)
    name = spec.partition(":")[0]
    assert message == f"schedule {name}: unknown setting {item} (allowed: {allowed})"


@pytest.mark.parametrize(
    ("spec", "shown"),
    [
        ("step:every=ten", "every='ten'"),
        ("exponential:gamma=", "gamma=''"),
        ("cosine:min=0.5.5", "min='0.5.5'"),
        ("plateau:factor=1/2", "factor='1/2'"),
    ],
)
def test_a_setting_that_is_not_a_number_is_refused_naming_it(spec: str, shown: str):
    assert refusal(spec) == f"schedule {spec.partition(':')[0]}: {shown} is not a number"


@pytest.mark.parametrize(
    "spec",
    [
        "exponential:gamma=inf",
        "exponential:gamma=nan",
        "step:gamma=-inf",
        "cosine:min=nan",
        "linear:end=inf",
        "plateau:min=inf",
        "plateau:threshold=nan",
    ],
)
def test_a_non_finite_setting_is_refused(spec: str):
    key = spec.partition(":")[2].partition("=")[0]
    message = refusal(spec)
    assert f"{key} must be finite" in message


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("step:every=0", "every must be a whole number of epochs >= 1, got 0"),
        ("step:every=-2", "every must be a whole number of epochs >= 1, got -2"),
        ("step:every=2.5", "every must be a whole number of epochs >= 1, got 2.5"),
        ("step:every=0.5", "every must be a whole number of epochs >= 1, got 0.5"),
        ("step:gamma=-0.1", "gamma must be >= 0 (0 stops the run), got -0.1"),
        ("exponential:gamma=-1", "gamma must be >= 0 (0 stops the run), got -1"),
        ("cosine:min=-0.1", "min must be in [0, 1], got -0.1"),
        ("cosine:min=1.5", "min must be in [0, 1], got 1.5"),
        ("linear:end=0", "end must be the epoch at which the factor reaches 0 (> 0), got 0"),
        ("linear:end=-3", "end must be the epoch at which the factor reaches 0 (> 0), got -3"),
        ("plateau:patience=-1", "patience must be a whole number >= 0, got -1"),
        ("plateau:patience=1.5", "patience must be a whole number >= 0, got 1.5"),
        ("plateau:factor=1", "factor must be in [0, 1) (0 stops the run), got 1"),
        ("plateau:factor=1.5", "factor must be in [0, 1) (0 stops the run), got 1.5"),
        ("plateau:factor=-0.5", "factor must be in [0, 1) (0 stops the run), got -0.5"),
        ("plateau:threshold=1", "threshold must be in [0, 1), got 1"),
        ("plateau:threshold=-0.01", "threshold must be in [0, 1), got -0.01"),
        (
            "plateau:min=-0.25",
            "min must be in [0, 1] (a floor under the falling factor), got -0.25",
        ),
    ],
)
def test_an_out_of_range_setting_is_refused_naming_it_and_its_range(spec: str, expected: str):
    name = spec.partition(":")[0]
    assert refusal(spec) == f"schedule {name}: {expected}"


def test_a_schedule_refusal_is_a_config_error_and_a_value_error():
    with pytest.raises(ValueError):
        parse_schedule("step:every=0", 3)


# ----------------------------------------------------------------------------- factors


@pytest.mark.parametrize("epochs", [1, 5])
def test_constant_is_one_throughout(epochs: int):
    assert factors(parse_schedule("constant", epochs), [3.0, None, 1.0, 9.0]) == [1.0] * 4


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        # the factor for epoch e+1 after epoch e: gamma ** ((e + 1) // every)
        ("step:every=2,gamma=0.5", [1.0, 0.5, 0.5, 0.25, 0.25, 0.125]),
        ("step:every=1,gamma=0.5", [0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625]),
        ("step:every=3,gamma=0.25", [1.0, 1.0, 0.25, 0.25, 0.25, 0.0625]),
        ("step:every=2,gamma=0", [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]),  # 0 ** 0 == 1, then stop
        ("step:every=1,gamma=2", [2.0, 4.0, 8.0, 16.0, 32.0, 64.0]),
    ],
)
def test_step_multiplies_by_gamma_every_n_epochs(spec: str, expected: list[float]):
    assert factors(parse_schedule(spec, 10), [1.0] * 6) == expected


@pytest.mark.parametrize(
    ("gamma", "expected"),
    [
        (0.5, [0.5, 0.25, 0.125, 0.0625]),
        (1.0, [1.0, 1.0, 1.0, 1.0]),
        (0.0, [0.0, 0.0, 0.0, 0.0]),
    ],
)
def test_exponential_is_gamma_to_the_next_epoch(gamma: float, expected: list[float]):
    assert factors(parse_schedule(f"exponential:gamma={gamma}", 10), [1.0] * 4) == expected


def test_exponential_ignores_the_loss_and_the_factor_passed_in():
    schedule = parse_schedule("exponential:gamma=0.5", 10)
    assert schedule.next_factor(2, None, 123.0, {}) == 0.125
    assert schedule.next_factor(2, 7.0, 0.001, {}) == 0.125


@pytest.mark.parametrize(
    ("spec", "epochs", "expected"),
    [
        # after epoch e: min + (1 - min) * (1 + cos(pi * (e + 1) / epochs)) / 2
        (
            "cosine:min=0",
            4,
            [(2 + math.sqrt(2)) / 4, 0.5, (2 - math.sqrt(2)) / 4, 0.0],
        ),
        (
            "cosine:min=0.2",
            4,
            [0.2 + 0.8 * (2 + math.sqrt(2)) / 4, 0.6, 0.2 + 0.8 * (2 - math.sqrt(2)) / 4, 0.2],
        ),
        ("cosine:min=0", 2, [0.5, 0.0]),
        ("cosine:min=1", 3, [1.0, 1.0, 1.0]),
    ],
)
def test_cosine_falls_from_one_to_min_over_the_run(spec: str, epochs: int, expected: list[float]):
    got = factors(parse_schedule(spec, epochs), [1.0] * epochs)
    assert got == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("epochs", [1, 2, 3, 10, 100])
@pytest.mark.parametrize("low", [0.0, 0.1, 0.5])
def test_cosine_keeps_every_epoch_that_runs_above_min_and_never_rises(epochs: int, low: float):
    got = factors(parse_schedule(f"cosine:min={low}", epochs), [1.0] * epochs)
    ran_at = [1.0, *got[:-1]]  # the factor each epoch 0..epochs-1 ran at
    assert all(f > low for f in ran_at)
    assert ran_at == sorted(ran_at, reverse=True)
    # after the last epoch the schedule is at min (and stays there if asked again)
    assert got[-1] == pytest.approx(low, abs=1e-12)
    schedule = parse_schedule(f"cosine:min={low}", epochs)
    assert schedule.next_factor(epochs + 5, None, 1.0, {}) == pytest.approx(low, abs=1e-12)


@pytest.mark.parametrize(
    ("end", "expected"),
    [
        (4, [0.75, 0.5, 0.25, 0.0, -0.25]),
        (2, [0.5, 0.0, -0.5, -1.0, -1.5]),
        (1, [0.0, -1.0, -2.0, -3.0, -4.0]),
        (8, [0.875, 0.75, 0.625, 0.5, 0.375]),
    ],
)
def test_linear_is_one_minus_next_epoch_over_end(end: int, expected: list[float]):
    assert factors(parse_schedule(f"linear:end={end}", 20), [1.0] * 5) == expected


@pytest.mark.parametrize("end", [1, 2, 3, 7, 2.5, 0.5])
def test_linear_reaches_zero_or_below_exactly_when_epoch_end_would_run(end: float):
    schedule = parse_schedule(f"linear:end={end}", 50)
    got = factors(schedule, [1.0] * 10)
    # got[e] is the factor for epoch e + 1: it is <= 0 from epoch ceil(end) on, > 0 before
    for epoch in range(1, 11):
        assert (got[epoch - 1] <= 0) == (epoch >= end), (end, epoch, got[epoch - 1])


def test_linear_with_end_three_runs_epochs_zero_to_two():
    got = factors(parse_schedule("linear:end=3", 10), [1.0] * 3)
    assert got[:2] == pytest.approx([2 / 3, 1 / 3])
    assert got[0] > 0 and got[1] > 0
    assert got[2] <= 0


# plateau:patience=2,factor=0.5,threshold=0.25,min=0.2 -- an improvement must be below 0.75*best
PLATEAU_TABLE: list[tuple[float | None, float, dict[str, Any]]] = [
    # monitored, factor for the next epoch, state after the epoch
    (8.0, 1.0, {"best": 8.0, "bad": 0}),  # the first value is the best
    (7.0, 1.0, {"best": 8.0, "bad": 1}),  # 7 is not below 6: not an improvement (relative)
    (None, 1.0, {"best": 8.0, "bad": 1}),  # not validated: the count does not move
    (6.0, 1.0, {"best": 8.0, "bad": 2}),  # exactly 0.75*best is not below it
    (7.0, 0.5, {"best": 8.0, "bad": 0}),  # more than 2 bad epochs: halve, count restarts
    (None, 0.5, {"best": 8.0, "bad": 0}),
    (5.5, 0.5, {"best": 5.5, "bad": 0}),  # below 6: the new best, the count resets
    (5.5, 0.5, {"best": 5.5, "bad": 1}),
    (5.0, 0.5, {"best": 5.5, "bad": 2}),  # lower, but not by 25%
    (None, 0.5, {"best": 5.5, "bad": 2}),
    (None, 0.5, {"best": 5.5, "bad": 2}),
    (5.0, 0.25, {"best": 5.5, "bad": 0}),
    (5.0, 0.25, {"best": 5.5, "bad": 1}),
    (5.0, 0.25, {"best": 5.5, "bad": 2}),
    (5.0, 0.2, {"best": 5.5, "bad": 0}),  # 0.125 is below min: held at 0.2
    (5.0, 0.2, {"best": 5.5, "bad": 1}),
    (5.0, 0.2, {"best": 5.5, "bad": 2}),
    (5.0, 0.2, {"best": 5.5, "bad": 0}),  # at the floor it stays there
    (4.0, 0.2, {"best": 4.0, "bad": 0}),  # an improvement does not raise it again
]


def test_plateau_table():
    schedule = parse_schedule("plateau:patience=2,factor=0.5,threshold=0.25,min=0.2", 100)
    factor, state = 1.0, {}
    for epoch, (monitored, expected, expected_state) in enumerate(PLATEAU_TABLE):
        factor = schedule.next_factor(epoch, monitored, factor, state)
        assert (factor, state) == (expected, expected_state), epoch


def test_plateau_an_unvalidated_epoch_leaves_state_and_factor_exactly_alone():
    schedule = parse_schedule("plateau:patience=0", 10)
    state = {"best": 2.0, "bad": 0}
    assert schedule.next_factor(5, None, 0.375, state) == 0.375
    assert state == {"best": 2.0, "bad": 0}
    assert schedule.next_factor(5, None, 0.375, {}) == 0.375  # nothing seen yet, still nothing


@pytest.mark.parametrize(
    ("patience", "expected"),
    [
        # monitored 4, 4, 4, 4, 4, 4: the first sets the best, then one bad epoch after another
        (0, [1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125]),
        (1, [1.0, 1.0, 0.5, 0.5, 0.25, 0.25]),
        (2, [1.0, 1.0, 1.0, 0.5, 0.5, 0.5]),
        (5, [1.0] * 6),
    ],
)
def test_plateau_reduces_after_more_than_patience_bad_epochs(patience: int, expected: list[float]):
    schedule = parse_schedule(f"plateau:patience={patience},factor=0.5,threshold=0", 10)
    assert factors(schedule, [4.0] * 6) == expected


def test_plateau_threshold_is_relative_to_the_best():
    schedule = parse_schedule("plateau:patience=0,factor=0.5,threshold=0.5", 10)
    # best 100: 60 is 40% lower (not enough), 49 is 51% lower (enough)
    assert factors(schedule, [100.0, 60.0]) == [1.0, 0.5]
    assert factors(schedule, [100.0, 49.0]) == [1.0, 1.0]
    # the same absolute drop of 40 counts at a best of 50 (to 10), not at 100
    assert factors(schedule, [50.0, 10.0]) == [1.0, 1.0]


def test_plateau_with_threshold_zero_counts_any_strict_decrease():
    schedule = parse_schedule("plateau:patience=0,factor=0.5,threshold=0", 10)
    assert factors(schedule, [3.0, 2.999, 2.999, 1.0]) == [1.0, 1.0, 0.5, 0.5]


def test_plateau_factor_zero_drops_to_zero_despite_min():
    schedule = parse_schedule("plateau:patience=1,factor=0,min=0.5", 10)
    assert factors(schedule, [2.0, 2.0, 2.0]) == [1.0, 1.0, 0.0]


def test_plateau_min_floor_holds_from_above():
    schedule = parse_schedule("plateau:patience=0,factor=0.25,min=0.1", 10)
    assert factors(schedule, [1.0, 1.0, 1.0, 1.0]) == [1.0, 0.25, 0.1, 0.1]


# A plateau only ever lowers the factor: a floor above the current factor cannot raise it.
@pytest.mark.parametrize("low", [1.5, 2.0])
def test_plateau_never_raises_the_factor(low: float):
    try:
        schedule = parse_schedule(f"plateau:patience=0,factor=0.5,min={low}", 10)
    except ConfigError as exc:
        assert "min" in str(exc)
        return
    got = factors(schedule, [1.0, 1.0, 1.0])
    assert all(f <= 1.0 for f in got), got


@PROPERTY
@given(
    st.integers(0, 4),
    st.sampled_from([0.0, 0.1, 0.5, 0.9]),
    st.sampled_from([0.0, 1e-4, 0.1]),
    st.sampled_from([0.0, 0.05, 0.3]),
    st.lists(st.floats(0, 100) | st.none(), max_size=40),
)
def test_plateau_never_rises_and_never_drops_below_min_unless_it_stops(
    patience: int, reduce: float, threshold: float, low: float, losses: list[float | None]
):
    schedule = parse_schedule(
        f"plateau:patience={patience},factor={reduce},threshold={threshold},min={low}", 10
    )
    previous = 1.0
    for factor in factors(schedule, losses):
        assert factor <= previous
        assert factor == 0.0 or factor >= min(low, previous)
        previous = factor


@pytest.mark.parametrize(
    ("spec", "note"),
    [
        (
            "step:every=2",
            "learning-rate schedule step:every=2,gamma=0.1: gamma=0.1 is its default (name it in "
            "--lr-schedule to choose otherwise)",
        ),
        (
            "plateau:patience=2,factor=0.5",
            "learning-rate schedule plateau:factor=0.5,min=0,patience=2,threshold=0.0001: min=0, "
            "threshold=0.0001 are its defaults (name them in --lr-schedule to choose otherwise)",
        ),
        ("step:every=2,gamma=0.5", None),
        ("step: gamma=0.5 , every=3", None),
        ("constant", None),
    ],
)
def test_a_setting_left_to_its_default_is_named_once_at_the_start(spec: str, note: str | None):
    assert parse_schedule(spec, 10).defaults_note() == note
