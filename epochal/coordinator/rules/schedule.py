"""Learning-rate schedules, decided by the coordinator and sent to every rank with each Go.

A schedule yields a *factor*: the worker sets each parameter group's learning rate to its initial
value times the factor. A factor <= 0 stops the run (lamp's convention), so ``linear`` both
decays the rate and ends training. Schedules are pure: :meth:`Schedule.next_factor` takes the
epoch that just ended, the monitored loss it produced (None when it was not validated) and the
schedule's own small state dict (JSON-serialisable, kept in the journal), and returns the factor
for the next epoch.

Specs are written ``NAME`` or ``NAME:key=value,key=value``:

=============================================  ==================================================
``constant``                                   factor 1 throughout (the default)
``step:every=N,gamma=G``                       ``G ** (epoch // N)``
``exponential:gamma=G``                        ``G ** epoch``
``cosine:min=M``                               from 1 down to ``M`` over the run's epochs (the
                                               epochs it had, when kept: ``--keep-schedule``)
``linear:end=E``                               ``1 - epoch / E``: reaches 0 at epoch ``E`` and stops
``plateau:patience=P,factor=F,threshold=T,min=M``  multiply by ``F`` after ``P`` validated epochs
                                               without a relative improvement of ``T`` in the
                                               smoothed monitored value; never below ``M``
                                               (``F=0`` stops)
``warmup-cosine:warmup=W,steps=S,min=M``       per optimizer step, not per epoch: rises over the
                                               first ``W`` steps, then falls along a half cosine
                                               to ``M`` at step ``S`` (0: the run's last step);
                                               needs ``--steps-per-epoch``
=============================================  ==================================================

``warmup-cosine`` is the one per-step schedule: every rank applies its factor at each optimizer
step from the run's global step (:mod:`epochal.steprates`), and the coordinator's factor for an
epoch is the one at its last step, which the epoch line and the journal show.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from epochal.errors import ConfigError
from epochal.protocol import StepRates
from epochal.steprates import warmup_cosine

State = dict[str, Any]

_PARAMS: dict[str, dict[str, float]] = {
    "constant": {},
    "step": {"every": 10.0, "gamma": 0.1},
    "exponential": {"gamma": 0.95},
    "cosine": {"min": 0.0},
    "linear": {"end": 0.0},
    "plateau": {"patience": 3.0, "factor": 0.5, "threshold": 1e-4, "min": 0.0},
    "warmup-cosine": {"warmup": 0.0, "steps": 0.0, "min": 0.0},
}
SCHEDULE_NAMES = tuple(_PARAMS)


@dataclass(frozen=True, slots=True)
class Schedule:
    """A parsed schedule spec; ``epochs`` is the run's epoch count (cosine spans it)."""

    name: str
    params: dict[str, float] = field(default_factory=dict)
    epochs: int = 1
    given: frozenset[str] = field(default=frozenset(), compare=False)
    """The settings the spec named; the others are their defaults."""
    held: bool = False
    """The curve was kept over ``epochs`` when the run was given more (``--keep-schedule``): the
    factor of its last epoch holds for the epochs after it."""
    steps_per_epoch: int | None = None
    """The run's ``--steps-per-epoch`` (a per-step schedule needs it)."""

    def defaults_note(self) -> str | None:
        """One line naming the settings the spec left to their defaults (``step:every=2`` takes
        ``gamma=0.1``), so that nobody trains with a default they did not know; None when the
        spec named every setting."""
        taken = [k for k in sorted(self.params) if k not in self.given]
        if not taken:
            return None
        listed = ", ".join(f"{k}={_number(self.params[k])}" for k in taken)
        which = "is its default" if len(taken) == 1 else "are its defaults"
        return (
            f"learning-rate schedule {self.spec}: {listed} {which} (name "
            f"{'it' if len(taken) == 1 else 'them'} in --lr-schedule to choose otherwise)"
        )

    @property
    def spans_epochs(self) -> bool:
        """Whether the factors depend on the run's epoch count (``cosine`` spans it): a run
        given more epochs continues on another curve."""
        return self.name == "cosine" or (self.per_step and self.params["steps"] == 0)

    @property
    def per_step(self) -> bool:
        """Whether the workers set the factor at every optimizer step (``warmup-cosine``)."""
        return self.name == "warmup-cosine"

    def step_rates(self) -> StepRates | None:
        """What a welcome sends of a per-step schedule: its warm-up steps, decay steps
        (``steps=0`` resolved to the run's last step) and floor; None for a per-epoch one."""
        if not self.per_step:
            return None
        assert self.steps_per_epoch is not None  # parse_schedule refuses a per-step one without
        steps = int(self.params["steps"]) or self.epochs * self.steps_per_epoch
        return StepRates(warmup=int(self.params["warmup"]), steps=steps, floor=self.params["min"])

    def end_factor(self, epoch: int) -> float:
        """A per-step schedule's factor at the last optimizer step of ``epoch``."""
        rates = self.step_rates()
        assert rates is not None and self.steps_per_epoch is not None
        last = (epoch + 1) * self.steps_per_epoch - 1
        return warmup_cosine(last, warmup=rates.warmup, steps=rates.steps, floor=rates.floor)

    def first_factor(self) -> float:
        """The factor of epoch 0: 1, or a per-step schedule's at that epoch's last step."""
        return self.end_factor(0) if self.per_step else 1.0

    @property
    def spec(self) -> str:
        if not self.params:
            return self.name
        return (
            self.name + ":" + ",".join(f"{k}={_number(v)}" for k, v in sorted(self.params.items()))
        )

    def next_factor(
        self, epoch: int, monitored: float | None, factor: float, state: State
    ) -> float:
        """The factor for ``epoch + 1`` after ``epoch`` ended with ``monitored`` (None: no loss);
        lower ``monitored`` is better."""
        p = self.params
        nxt = epoch + 1
        match self.name:
            case "constant":
                return 1.0
            case "warmup-cosine":
                return self.end_factor(nxt)
            case "step":
                return float(p["gamma"] ** (nxt // int(p["every"])))
            case "exponential":
                return float(p["gamma"] ** nxt)
            case "cosine":
                last = self.epochs - 1 if self.held else self.epochs
                progress = min(nxt, last) / self.epochs  # the last epoch stays above min
                return p["min"] + (1 - p["min"]) * (1 + math.cos(math.pi * progress)) / 2
            case "linear":
                return 1.0 - nxt / p["end"]
            case "plateau":
                if monitored is None:
                    return factor  # no loss this epoch: the plateau count does not move
                best = state.get("best")
                # lower is better (the caller negates a maximised metric); a relative threshold
                # on a negative best moves the line down too
                line = None if best is None else best - abs(best) * p["threshold"]
                if best is not None and best >= 0:
                    line = best * (1 - p["threshold"])  # as ever for a loss, to the last bit
                if line is None or monitored < line:
                    state["best"], state["bad"] = monitored, 0
                    return factor
                state["bad"] = int(state.get("bad", 0)) + 1
                if state["bad"] <= int(p["patience"]):
                    return factor
                state["bad"] = 0
                reduced = factor * p["factor"]
                return reduced if reduced <= 0 else min(factor, max(reduced, p["min"]))
        raise AssertionError(f"unknown schedule {self.name}")  # parse_schedule admits no other


def _number(value: float) -> str:
    """Shortest text that reads back as exactly ``value`` (``10`` rather than ``10.0``)."""
    return str(int(value)) if value.is_integer() else repr(value)


def parse_schedule(spec: str, epochs: int, steps_per_epoch: int | None = None) -> Schedule:
    """Parse ``NAME[:key=value,...]``; ConfigError naming what is wrong and what is allowed.
    ``steps_per_epoch``: the run's ``--steps-per-epoch``, which a per-step schedule needs."""
    name, _, rest = spec.strip().partition(":")
    if name not in _PARAMS:
        raise ConfigError(
            f"unknown learning-rate schedule {name!r}: use one of {', '.join(SCHEDULE_NAMES)} "
            "(e.g. step:every=10,gamma=0.5)"
        )
    params = dict(_PARAMS[name])
    given: set[str] = set()
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, raw = item.partition("=")
        if not eq or key not in params:
            allowed = ", ".join(params) or "none"
            raise ConfigError(f"schedule {name}: unknown setting {item!r} (allowed: {allowed})")
        try:
            params[key] = float(raw)
        except ValueError:
            raise ConfigError(f"schedule {name}: {key}={raw!r} is not a number") from None
        given.add(key)
    _check(name, params)
    if name == "warmup-cosine" and steps_per_epoch is None:
        raise ConfigError(
            f"schedule {name} counts optimizer steps, which the run numbers only with epochs "
            "of a fixed length: run with --steps-per-epoch N"
        )
    if name == "warmup-cosine" and not params["steps"]:
        assert steps_per_epoch is not None
        if params["warmup"] > epochs * steps_per_epoch:
            raise ConfigError(
                f"schedule {name}: warmup={_number(params['warmup'])} is longer than the run's "
                f"{epochs * steps_per_epoch} steps: warm up for fewer steps or give steps=S"
            )
    return Schedule(
        name=name,
        params=params,
        epochs=epochs,
        given=frozenset(given),
        steps_per_epoch=steps_per_epoch,
    )


def _check(name: str, p: dict[str, float]) -> None:
    def bad(message: str) -> ConfigError:
        return ConfigError(f"schedule {name}: {message}")

    for key, value in p.items():
        if not math.isfinite(value):
            raise bad(f"{key} must be finite, got {value}")
    if name == "step" and (p["every"] < 1 or p["every"] != int(p["every"])):
        raise bad(f"every must be a whole number of epochs >= 1, got {p['every']:g}")
    if name in ("step", "exponential") and p["gamma"] < 0:
        raise bad(f"gamma must be >= 0 (0 stops the run), got {p['gamma']:g}")
    if name == "cosine" and not 0 <= p["min"] <= 1:
        raise bad(f"min must be in [0, 1], got {p['min']:g}")
    if name == "linear" and p["end"] <= 0:
        raise bad(f"end must be the epoch at which the factor reaches 0 (> 0), got {p['end']:g}")
    if name == "warmup-cosine":
        for key in ("warmup", "steps"):
            if p[key] < 0 or p[key] != int(p[key]):
                raise bad(f"{key} must be a whole number of optimizer steps >= 0, got {p[key]:g}")
        if p["steps"] and p["steps"] < p["warmup"]:
            raise bad(
                f"steps ({p['steps']:g}) is where the decay ends, so it must not come before "
                f"the warm-up's end (warmup={p['warmup']:g}); 0 ends it at the run's last step"
            )
        if not 0 <= p["min"] <= 1:
            raise bad(f"min must be in [0, 1], got {p['min']:g}")
    if name == "plateau":
        if p["patience"] < 0 or p["patience"] != int(p["patience"]):
            raise bad(f"patience must be a whole number >= 0, got {p['patience']:g}")
        if not 0 <= p["factor"] < 1:
            raise bad(f"factor must be in [0, 1) (0 stops the run), got {p['factor']:g}")
        if not 0 <= p["threshold"] < 1:
            raise bad(f"threshold must be in [0, 1), got {p['threshold']:g}")
        if not 0 <= p["min"] <= 1:
            raise bad(f"min must be in [0, 1] (a floor under the falling factor), got {p['min']:g}")
