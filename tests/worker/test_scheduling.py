"""A per-step scheduler placed at a global step has the rates it has after that many steps."""

from __future__ import annotations

import warnings

import pytest
import torch

from epochal.errors import ConfigError
from epochal.worker.training.scheduling import StepScheduler


def built() -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=30)
    return optimizer, scheduler


@pytest.mark.parametrize(("stepped", "placed"), [(0, 7), (12, 4), (9, 9), (5, 20)])
def test_placed_at_a_step_has_the_rates_of_that_many_steps(stepped, placed):
    optimizer, scheduler = built()
    steps = StepScheduler(scheduler, optimizer)
    for _ in range(stepped):
        steps.step()
    steps.place(placed)
    reference, ref_scheduler = built()
    with warnings.catch_warnings():  # torch warns of a scheduler stepped with no optimizer step
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(placed):
            ref_scheduler.step()
    assert steps.at == placed
    assert optimizer.param_groups[0]["lr"] == reference.param_groups[0]["lr"]
    assert optimizer.param_groups[0]["momentum"] == reference.param_groups[0]["momentum"]


def test_a_plateau_scheduler_or_another_optimizers_is_refused():
    optimizer, _ = built()
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    with pytest.raises(ConfigError, match="plateau"):
        StepScheduler(plateau, optimizer)
    _, scheduler = built()  # its own optimizer
    with pytest.raises(ConfigError, match="another optimizer"):
        StepScheduler(scheduler, optimizer)
