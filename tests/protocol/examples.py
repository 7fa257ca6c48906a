"""Valid examples of every record, derived from its declared fields.

:func:`examples` builds instances of a message (or of any record) from what its fields declare:
every bounded value at its smallest and at its largest, each member of a closed set in turn, None
and a value for a nilable field, lists empty, with one item and full, nested records built the
same way. A new message of plain fields needs nothing here: tests/protocol/test_codec.py's round
trip covers every registered message with these. What is not declared on the types cannot be
derived: a check between fields (a class's ``_validate``) has its agreement written in
:data:`AGREE`, a constraint of its own in :data:`CUSTOM`; a message whose values cannot be derived
fails the round trip, naming itself.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from collections.abc import Callable
from typing import Any

from epochal.protocol.messages import (
    MAX_METRIC_NAME_CHARS,
    Awaiting,
    Chars,
    Decision,
    EpochReport,
    FieldSpec,
    Finite,
    Ge,
    Go,
    Joined,
    Length,
    Liveness,
    MetricName,
    ModelPage,
    OneOf,
    ParamSpec,
    Phase,
    Record,
    Status,
    StepRates,
    Welcome,
    Within,
    fields_of,
)
from epochal.protocol.paging import model_page

WIDE = "\U0001f600"
"""Four bytes in UTF-8: a string of these is as long in bytes as its characters allow."""
UINT64 = 2**64 - 1
"""The widest integer msgpack packs (9 bytes)."""
INT64_MIN = -(2**63)


@dataclasses.dataclass(frozen=True)
class Profile:
    """Which value each field of one example takes."""

    index: int
    # the member of a closed set each field takes (cycling through its members)
    largest: bool
    # each bounded value at its largest (else its smallest); lists full (else empty or one item)
    nil: bool
    # nilable fields None (else a value); lists empty
    longest_member: bool = False
    # closed sets at their longest value (the frame-size check), whatever ``index``


LARGEST = Profile(0, largest=True, nil=False, longest_member=True)
"""Every value at its widest: the largest frame a message can make."""


class CannotDerive(TypeError):
    """A field or record whose valid values its declaration does not say."""


@functools.cache
def wide(chars: int) -> str:
    return WIDE * chars


def _metric_name(profile: Profile, index: int) -> str:
    if profile.largest:  # distinct in a full list, each at the longest a name may be
        return f"m{index:0{MAX_METRIC_NAME_CHARS - 1}d}"
    return f"m{index}" if index else "m"


CUSTOM: dict[type, Callable[[Profile, int], Any]] = {MetricName: _metric_name}
"""The value a constraint of its own allows, for the example's profile and the item's index in
its list (items that must differ, do)."""


def _members(spec: FieldSpec) -> list[str]:
    for c in spec.constraints:
        if isinstance(c, OneOf):
            return [member.value for member in c.choices]
    return []


def _value(spec: FieldSpec, profile: Profile, owner: str, index: int) -> Any:
    if spec.nilable and profile.nil:
        return None
    where = f"{owner}.{spec.name}"
    members = _members(spec)
    if members:
        if profile.longest_member:
            return max(members, key=len)
        return members[profile.index % len(members)]
    for c in spec.constraints:
        if type(c) in CUSTOM:
            return CUSTOM[type(c)](profile, index)
    if spec.kind is int:
        for c in spec.constraints:
            if isinstance(c, Within):
                return c.highest if profile.largest else c.lowest
            if isinstance(c, Ge):
                return UINT64 if profile.largest else c.least
        return UINT64 if profile.largest else INT64_MIN
    if spec.kind is float:
        if any(isinstance(c, Finite) for c in spec.constraints):
            return sys.float_info.max if profile.largest else -sys.float_info.max
        return math.inf if profile.largest else -math.inf
    if spec.kind is bool:
        return profile.largest
    if spec.kind is str:
        for c in spec.constraints:
            if isinstance(c, Chars):
                return wide(c.most) if profile.largest else ("" if c.empty else "x")
            if isinstance(c, Length):
                return wide(c.most) if profile.largest else "s" * c.least
        raise CannotDerive(f"{where}: a string without a bound (Chars or Length)")
    if spec.kind is tuple:
        assert spec.item is not None
        count = spec.max_items if profile.largest else 0 if profile.nil else 1
        return tuple(_value(spec.item, profile, where, i) for i in range(count))
    if issubclass(spec.kind, Record):
        return variants(spec.kind, profile, index)[0]
    raise CannotDerive(f"{where}: no example of a {spec.kind.__name__}")


Agree = Callable[[dict[str, Any], Profile], list[dict[str, Any]]]


def _welcome(values: dict[str, Any], profile: Profile) -> list[dict[str, Any]]:
    # a rank of the world; a checkpoint directory to resume from
    rank = values["world_size"] - 1 if profile.largest else 0
    resume = values["resume_epoch"] is not None
    return [values | {"rank": rank, "checkpoint_dir": values["checkpoint_dir"] or "/" * resume}]


def _joined(values: dict[str, Any], profile: Profile) -> list[dict[str, Any]]:
    # as many joined as the world holds, at most
    return [values | {"joined": values["world_size"] if profile.largest else 1}]


def _status(values: dict[str, Any], profile: Profile) -> list[dict[str, Any]]:
    # what it awaits exactly when it waits: then each answer in turn
    if values["phase"] == Phase.WAITING:
        return [values | {"awaiting": awaiting.value} for awaiting in Awaiting]
    return [values | {"awaiting": None}]


def _epoch_report(values: dict[str, Any], profile: Profile) -> list[dict[str, Any]]:
    # the next epoch's counts are for the next epoch
    epoch = UINT64 - 1 if profile.largest else values["epoch"]
    ready = values["ready"]
    ready = None if ready is None else dataclasses.replace(ready, epoch=epoch + 1)
    return [values | {"epoch": epoch, "ready": ready}]


def _decision(values: dict[str, Any], profile: Profile) -> list[dict[str, Any]]:
    # a go exactly when the run goes on without gathering, for the next epoch: one of each
    epoch = UINT64 - 1 if profile.largest else values["epoch"]
    go = values["go"] or variants(Go, dataclasses.replace(profile, nil=False))[0]
    return [
        values | {"epoch": epoch, "stop": True, "go": None, "gather": False},
        values
        | {
            "epoch": epoch,
            "stop": False,
            "go": dataclasses.replace(go, epoch=epoch + 1),
            "gather": False,
        },
        values | {"epoch": epoch, "stop": False, "go": None, "gather": True},
    ]


def _param_spec(values: dict[str, Any], profile: Profile) -> list[dict[str, Any]]:
    # no dimension is negative
    return [values | {"shape": tuple(max(0, d) for d in values["shape"])}]


def _model_page(values: dict[str, Any], profile: Profile) -> list[dict[str, Any]]:
    # as many entries as fit in a frame, within the model's
    params = model_page(values["params"], 0).params
    first, entries = values["first"], values["entries"]
    if first + len(params) > entries:
        if profile.largest:
            first = entries - len(params)
        else:
            entries = first + len(params)
    return [values | {"params": params, "first": first, "entries": entries}]


def _liveness(values: dict[str, Any], profile: Profile) -> list[dict[str, Any]]:
    # the timeout exceeds a positive interval
    timeout = abs(values["timeout"]) or 1.0
    return [values | {"interval": timeout / 2, "timeout": timeout}]


def _step_rates(values: dict[str, Any], profile: Profile) -> list[dict[str, Any]]:
    # the floor lies in [0, 1] and the decay ends no earlier than the warm-up
    warmup = min(values["steps"], values["warmup"])
    return [values | {"floor": 0.5, "warmup": warmup}, values | {"floor": 1.0, "warmup": warmup}]


AGREE: dict[type, Agree] = {
    Liveness: _liveness,
    StepRates: _step_rates,
    Welcome: _welcome,
    Joined: _joined,
    Status: _status,
    EpochReport: _epoch_report,
    Decision: _decision,
    ModelPage: _model_page,
    ParamSpec: _param_spec,
}
"""How the values of a record whose ``_validate`` relates its fields are made to agree: the
values derived for a profile in, the keyword arguments of one or more valid examples out."""


def variants(cls: type, profile: Profile, index: int = 0) -> list[Any]:
    """The valid examples of ``cls`` in ``profile`` (one, or one per way :data:`AGREE` makes its
    values agree), as item ``index`` of a list. Raises CannotDerive naming the class when a value
    cannot be derived or the record refuses the values."""
    values = {spec.name: _value(spec, profile, cls.__name__, index) for spec in fields_of(cls)}
    agree = AGREE.get(cls)
    made = agree(values, profile) if agree is not None else [values]
    try:
        return [cls(**v) for v in made]
    except ValueError as exc:
        raise CannotDerive(
            f"{cls.__name__}: the values derived from its declared fields do not make a valid "
            f"one ({exc}); say how they agree in tests/protocol/examples.py (AGREE)"
        ) from None


def _members_most(cls: type, seen: frozenset[type] = frozenset()) -> int:
    most = 0
    for spec in fields_of(cls):
        most = max(most, len(_members(spec)))
        kind = spec.item.kind if spec.item is not None else spec.kind
        if isinstance(kind, type) and issubclass(kind, Record) and kind not in seen:
            most = max(most, _members_most(kind, seen | {cls}))
    return most


def profiles(cls: type) -> list[Profile]:
    """The profiles of ``cls``'s examples: smallest with every nilable field None, largest,
    smallest with every part present, then alternately, until each member of every closed set
    it holds has had its turn."""
    count = max(3, _members_most(cls))
    return [Profile(k, largest=k % 2 == 1, nil=k == 0) for k in range(count)]


def examples(cls: type) -> list[Any]:
    """Valid examples of ``cls`` derived from its declared fields, each once."""
    found: list[Any] = []
    for profile in profiles(cls):
        for example in variants(cls, profile):
            if example not in found:
                found.append(example)
    return found


def largest_examples(cls: type) -> list[Any]:
    """The examples of ``cls`` with every bounded value at its largest: in every member of each
    closed set, and with each at its longest."""
    found: list[Any] = []
    count = max(1, _members_most(cls))
    for profile in [Profile(k, largest=True, nil=False) for k in range(count)] + [LARGEST]:
        for example in variants(cls, profile):
            if example not in found:
                found.append(example)
    return found
