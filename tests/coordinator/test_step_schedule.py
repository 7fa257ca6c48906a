"""The per-step schedule ``warmup-cosine``: its factor at chosen global steps, worked out by
hand, the factor the coordinator journals at each epoch's end, what a welcome carries, and the
specs it refuses.

Values exact in binary floating point are compared with ==, cosines with pytest.approx.
"""

from __future__ import annotations

import itertools
import math

import pytest

from epochal.coordinator.rules.loop import LoopState
from epochal.coordinator.rules.schedule import parse_schedule
from epochal.errors import ConfigError
from epochal.protocol import StepRates
from epochal.steprates import warmup_cosine


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (0, 0.25),  # the first step already trains, at a quarter of the rate
        (1, 0.5),
        (3, 1.0),  # the warm-up's last step reaches the full rate
        (4, 1.0),  # the decay's first step: cos(0)
        (7, 0.1 + 0.9 * (1 + math.cos(math.pi * 3 / 8)) / 2),
        (8, 0.55),  # half way down: the mean of 1 and the floor
        (12, 0.1),  # the decay's end
        (13, 0.1),  # and the floor after it
        (10_000, 0.1),
    ],
)
def test_warmup_then_cosine_at_chosen_global_steps(step: int, expected: float):
    assert warmup_cosine(step, warmup=4, steps=12, floor=0.1) == pytest.approx(expected, abs=1e-15)


def test_without_warmup_the_decay_starts_at_one_and_reaches_the_floor_at_steps():
    assert warmup_cosine(0, warmup=0, steps=10, floor=0.0) == 1.0
    assert warmup_cosine(5, warmup=0, steps=10, floor=0.0) == pytest.approx(0.5)
    assert warmup_cosine(10, warmup=0, steps=10, floor=0.0) == 0.0


def test_the_factor_rises_then_never_rises_again():
    values = [warmup_cosine(s, warmup=50, steps=400, floor=0.2) for s in range(500)]
    assert values[:50] == sorted(values[:50])
    assert all(a >= b for a, b in itertools.pairwise(values[49:]))
    assert min(values[50:]) == values[-1] == 0.2


def test_the_spec_parses_and_the_welcome_carries_its_numbers():
    schedule = parse_schedule("warmup-cosine:warmup=200,steps=10000,min=0.1", 40, 250)
    assert schedule.per_step
    assert schedule.spec == "warmup-cosine:min=0.1,steps=10000,warmup=200"
    assert schedule.step_rates() == StepRates(warmup=200, steps=10_000, floor=0.1)
    assert not schedule.spans_epochs
    assert parse_schedule("cosine", 40, 250).step_rates() is None


def test_steps_left_out_spans_the_run_and_says_so():
    schedule = parse_schedule("warmup-cosine:warmup=10", 8, 50)
    assert schedule.step_rates() == StepRates(warmup=10, steps=400, floor=0.0)
    assert schedule.spans_epochs
    note = schedule.defaults_note()
    assert note is not None and "min=0, steps=0 are its defaults" in note


def test_the_journaled_factor_is_the_one_at_each_epochs_last_step():
    schedule = parse_schedule("warmup-cosine:warmup=4,steps=12,min=0.1", 6, 4)
    loop = LoopState(epochs=6, schedule=schedule, lr_factor=schedule.first_factor())
    assert loop.lr_factor == 1.0  # step 3, the warm-up's last
    factors = [loop.update(e, 1.0, None, validates=False).lr_factor for e in range(3)]
    # epochs 0, 1 and 2 end at steps 3, 7 and 11
    assert factors[0] == 1.0
    assert factors[1] == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi * 3 / 8)) / 2)
    assert factors[2] == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi * 7 / 8)) / 2)


def test_a_floor_of_zero_reached_before_the_last_epoch_stops_the_run_there():
    schedule = parse_schedule("warmup-cosine:steps=8,min=0", 10, 4)
    loop = LoopState(epochs=10, schedule=schedule, lr_factor=schedule.first_factor())
    outcome = loop.update(0, 1.0, None, validates=False)
    assert not outcome.stop  # epoch 1 ends at step 7, above 0
    outcome = loop.update(1, 1.0, None, validates=False)
    assert outcome.stop and outcome.stop_reason == "lr_factor"  # epoch 2 would end at step 11


@pytest.mark.parametrize(
    ("spec", "steps_per_epoch", "expected"),
    [
        ("warmup-cosine", None, "run with --steps-per-epoch N"),
        ("warmup-cosine:warmup=2.5", 10, "warmup must be a whole number of optimizer steps"),
        ("warmup-cosine:steps=-1", 10, "steps must be a whole number of optimizer steps"),
        ("warmup-cosine:warmup=20,steps=10", 10, "must not come before the warm-up's end"),
        ("warmup-cosine:min=1.5", 10, "min must be in [0, 1]"),
        ("warmup-cosine:warmup=101", 10, "longer than the run's 100 steps"),
        ("warmup-cosine:cycles=2", 10, "allowed: warmup, steps, min"),
    ],
)
def test_bad_specs_are_refused_saying_why(spec: str, steps_per_epoch: int | None, expected: str):
    with pytest.raises(ConfigError) as info:
        parse_schedule(spec, 10, steps_per_epoch)
    assert expected in str(info.value)
