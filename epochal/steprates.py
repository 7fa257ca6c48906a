"""Per-step learning-rate factors: warm-up then cosine decay, given in optimizer steps.

The coordinator parses ``--lr-schedule warmup-cosine:...`` (``coordinator/rules/schedule.py``) and
sends the three numbers in each welcome (:class:`~epochal.protocol.records.StepRates`); every rank
then sets its rate at each optimizer step from the run's global step, ``epoch * N + step`` with
``N`` the steps per epoch, so the curve does not depend on where the run was interrupted, resumed or
regrouped. Pure: no clock, no torch; the coordinator uses the same function for the factor it
journals at each epoch's end.
"""

from __future__ import annotations

import math


def warmup_cosine(step: int, *, warmup: int, steps: int, floor: float) -> float:
    """The factor at global optimizer step ``step`` (0 is the first).

    Steps ``0 .. warmup-1`` rise linearly to 1 (step ``s`` gets ``(s+1)/warmup``, so the first
    step already trains); from ``warmup`` the factor falls along a half cosine from 1 to ``floor``,
    which it reaches at step ``steps`` and keeps after.
    """
    if step < warmup:
        return (step + 1) / warmup
    span = steps - warmup
    if span <= 0 or step >= steps:
        return floor
    progress = (step - warmup) / span
    return floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2
