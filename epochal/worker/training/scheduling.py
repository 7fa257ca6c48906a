"""torch's own learning-rate schedulers in :func:`~epochal.worker.training.train.train`,
stepped once after every optimizer step.

A scheduler's place is the run's global optimizer step, which every rank knows from the epoch
alone. :class:`StepScheduler` keeps the scheduler's state as it was built; when an epoch starts
where the scheduler does not stand (a resume, an epoch redone in a new world), it replays the
scheduler from that state to the epoch's first step, so the rates are those of a run that was
never broken. A replay costs one ``step()`` a step, microseconds each, and reads no checkpoint:
a rank of a new world, which has none of its own, finds the same place. Each step's rate is
the scheduler's alone, so the coordinator's schedules, which set a factor, are refused with it.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from epochal.errors import ConfigError


class StepScheduler:
    """``scheduler`` (built on ``optimizer``), stepped per optimizer step and placed at a global
    step by :meth:`place`."""

    def __init__(self, scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
        if isinstance(scheduler, ReduceLROnPlateau) or not isinstance(scheduler, LRScheduler):
            raise ConfigError(
                f"scheduler= takes a per-step torch.optim.lr_scheduler such as LambdaLR or "
                f"OneCycleLR, got a {type(scheduler).__name__}: for a plateau schedule use "
                "--lr-schedule plateau"
            )
        if scheduler.optimizer is not optimizer:
            raise ConfigError(
                "scheduler= is built on another optimizer than the one passed to train: build "
                "it on that one, e.g. OneCycleLR(optimizer, ...)"
            )
        self.scheduler = scheduler
        self.optimizer = optimizer
        self._built = copy.deepcopy(scheduler.state_dict())
        self._rates = [group["lr"] for group in optimizer.param_groups]
        self.at = 0
        """Optimizer steps the scheduler has followed: the global step it stands at."""

    def place(self, global_step: int) -> None:
        """Stand at ``global_step``: the optimizer's rates those of that step."""
        if global_step == self.at:
            return
        self.scheduler.load_state_dict(copy.deepcopy(self._built))
        for group, rate in zip(self.optimizer.param_groups, self._rates, strict=True):
            group["lr"] = rate
        self.at = 0
        for _ in range(global_step):
            self.step()

    def step(self) -> None:
        """After an optimizer step: the next step's rate."""
        with warnings.catch_warnings():
            # a replay steps the scheduler with no optimizer step before it, as torch warns
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()
        self.at += 1
