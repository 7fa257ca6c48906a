"""The records messages are made of: a model's fingerprint and its parameters' specs, a metric,
the heartbeat's timing.

A record is a frozen dataclass that travels inside a message, never alone; like a message's, its
fields' constraints are declared on their types and checked whenever one is made
(:mod:`epochal.protocol.constraints`). :mod:`epochal.protocol.messages` re-exports them with the
messages. This module's imports are private (underscored) or the parts' own names:
``from epochal.protocol.records import *`` exports exactly the protocol's names.
"""

import dataclasses as _dataclasses
from typing import Annotated as _Annotated
from typing import Any as _Any

from epochal.protocol.constraints import Chars, Finite, Items, Name, NonNeg, Positive, Within
from epochal.protocol.limits import MAX_METRICS, MAX_PARAMS, MAX_SHAPE_DIMS, MAX_TYPE_NAME_CHARS
from epochal.protocol.registry import Record
from epochal.protocol.strings import check_metric_name


@_dataclasses.dataclass(frozen=True, slots=True)
class ParamSpec(Record):
    """One named parameter or buffer of a model: its shape and dtype (an entry of a
    :class:`ModelPage`)."""

    name: Name
    shape: _Annotated[tuple[int, ...], Items(MAX_SHAPE_DIMS)]
    dtype: Name

    def _validate(self) -> None:
        if not all(d >= 0 for d in self.shape):
            raise ValueError(f"shape of {self.name} has a negative size")


@_dataclasses.dataclass(frozen=True, slots=True)
class MetricName:
    """The string is a metric name (:func:`check_metric_name`)."""

    def __call__(self, name: str, value: _Any) -> _Any:
        try:
            return check_metric_name(value)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None


@_dataclasses.dataclass(frozen=True, slots=True)
class Metric(Record):
    """One named metric of one split of an epoch: a sum over samples and the sample count.

    Its value is ``total / count``; sums and counts, not means, travel so that the coordinator
    weights every rank by its samples. ``total`` may be any float: a non-finite one aborts the run
    naming the rank, as a non-finite loss does.
    """

    name: _Annotated[str, MetricName()]
    total: float
    count: NonNeg


TypeName = _Annotated[str, Chars(most=MAX_TYPE_NAME_CHARS)]
"""A message type's wire name, as a hello or a welcome lists the optional ones it understands."""

Metrics = _Annotated[tuple[Metric, ...], Items(MAX_METRICS)]
"""The named metrics of one split of an epoch, each name once."""


@_dataclasses.dataclass(frozen=True, slots=True)
class Fingerprint(Record):
    """What must be identical on every rank, in a few dozen bytes: a digest of the model's
    parameters and buffers (names, shapes, dtypes, in order) and of the torch version.

    The entries themselves travel only when they are needed, and only from a worker whose hello
    showed the job's token: in :class:`ModelPage` s, answering :class:`DescribeModel`.
    """

    digest: Name
    # sha256 (hex) of the torch version and every entry, so equal models compare in O(1)
    torch_version: Name
    entries: _Annotated[int, Within(0, MAX_PARAMS)]
    # how many parameters and buffers the model has


@_dataclasses.dataclass(frozen=True, slots=True)
class StepRates(Record):
    """A learning-rate schedule set at every optimizer step (``--lr-schedule warmup-cosine``):
    each rank's factor at the run's global step ``s`` is
    :func:`~epochal.steprates.warmup_cosine` of these, so that every rank, and a resume, finds
    the same rate from the step alone."""

    warmup: NonNeg
    # optimizer steps of linear warm-up from 0 to 1
    steps: Positive
    # the global step at which the cosine decay reaches floor
    floor: _Annotated[float, Finite()] = 0.0
    # the factor the decay ends at, in [0, 1]

    def _validate(self) -> None:
        if not 0 <= self.floor <= 1:
            raise ValueError(f"floor must be in [0, 1], got {self.floor}")
        if self.steps < self.warmup:
            raise ValueError(f"steps ({self.steps}) must not come before warmup ({self.warmup})")


HEARTBEAT_INTERVAL = 1.0
"""The default time between two heartbeats, each way (``--heartbeat-interval``)."""

HEARTBEAT_TIMEOUT = 15.0
"""The default silence after which a peer counts as lost, each way (``--heartbeat-timeout``)."""


@_dataclasses.dataclass(frozen=True, slots=True)
class Liveness(Record):
    """How often each side of a run heartbeats, and how long a silence it takes for lost.

    One pair of values per run, the coordinator's (``--heartbeat-interval``,
    ``--heartbeat-timeout``): it sends them in :class:`Joined` and :class:`Welcome`, and every
    worker adopts them, so that the two sides never disagree on when the other is gone."""

    interval: _Annotated[float, Finite()] = HEARTBEAT_INTERVAL
    # seconds between two heartbeats
    timeout: _Annotated[float, Finite()] = HEARTBEAT_TIMEOUT
    # seconds of silence after which the other side is lost

    def _validate(self) -> None:
        if not 0 < self.interval < self.timeout:
            raise ValueError(
                f"the heartbeat timeout ({self.timeout:g} s) must exceed the heartbeat interval "
                f"({self.interval:g} s), which must be positive"
            )
