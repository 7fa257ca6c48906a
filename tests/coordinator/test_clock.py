"""The coordinator's own lost time: pure, with the clock as an argument."""

from __future__ import annotations

import pytest

from epochal.coordinator.rules.clock import GAP_SLACK, lost_time


@pytest.mark.parametrize(
    ("previous", "now", "step", "lost"),
    [
        (10.0, 10.1, 0.1, 0.0),  # a normal turn
        (10.0, 10.1 + GAP_SLACK, 0.1, 0.0),  # late, within the slack
        (10.0, 30.0, 0.1, 19.9),  # stopped for 20 s: all beyond the step was lost
        (10.0, 12.0, 0.05, 1.95),
        (10.0, 9.0, 0.1, 0.0),  # never negative
    ],
)
def test_lost_time(previous: float, now: float, step: float, lost: float):
    assert lost_time(previous, now, step) == pytest.approx(lost)
