"""A record's compiled checks do what its declared constraints say, word for word.

The reference is the plain walk the records did before the checks were compiled: every
constrained field, each constraint called in its declared order, a value a constraint turns into
another (a string into its enum member) kept. For every registered message and record, every
constrained field is given good and bad values of many kinds; the record made with each must end
as the walk says: the same ValueError (or TypeError) text, or the same fields.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from epochal.protocol.messages import MESSAGE_TYPES, Record, fields_of
from epochal.protocol.registry import _checks
from tests.protocol.examples import examples

TRIES: tuple[Any, ...] = (
    -1,
    0,
    1,
    2**64,
    -(2**63),
    0.5,
    math.nan,
    math.inf,
    -math.inf,
    "",
    "x",
    "train",
    "waiting",
    "x" * 100_000,
    (),
    ("a",) * 10_000,
    None,
    True,
)


def walked(record: Any) -> Any:
    """What the declared constraints make of ``record``'s fields: {name: value} or the error."""
    values = {}
    try:
        for name, nilable, constraints in _checks(type(record)):
            value = values[name] = getattr(record, name)
            if value is None and nilable:
                continue
            for constraint in constraints:
                value = constraint(name, value)
            values[name] = value
        record._validate()
    except (ValueError, TypeError, AttributeError) as exc:
        return (type(exc), str(exc))
    return values


def made(record: Any, name: str, value: Any) -> Any:
    """``record`` made again with field ``name`` set to ``value``: its fields, or the error."""
    try:
        built = dataclasses.replace(record, **{name: value})
    except (ValueError, TypeError, AttributeError) as exc:
        return (type(exc), str(exc))
    return {n: getattr(built, n) for n, _, _ in _checks(type(record))}


def records() -> list[type]:
    """Every registered message class and every record class found in their fields."""
    found: list[type] = []
    todo = list(MESSAGE_TYPES.values())
    while todo:
        cls = todo.pop()
        if cls in found:
            continue
        found.append(cls)
        for spec in fields_of(cls):
            kind = spec.item.kind if spec.item is not None else spec.kind
            if isinstance(kind, type) and issubclass(kind, Record):
                todo.append(kind)
    return sorted(found, key=lambda c: c.__name__)


@pytest.mark.parametrize("cls", records(), ids=lambda c: c.__name__)
def test_the_compiled_checks_end_as_the_declared_constraints_say(cls: type):
    checked = 0
    for example in examples(cls)[:2]:
        for name, _, _ in _checks(cls):
            for value in TRIES:
                # the reference: the record as it would be, walked by the declared constraints
                raw = object.__new__(cls)
                for field in dataclasses.fields(cls):
                    object.__setattr__(raw, field.name, getattr(example, field.name))
                object.__setattr__(raw, name, value)
                expected = walked(raw)
                got = made(example, name, value)
                if isinstance(expected, dict):
                    assert isinstance(got, dict), (name, value, got)
                    assert {k: (type(v), v) for k, v in got.items() if v == v} == {
                        k: (type(v), v) for k, v in expected.items() if v == v
                    }, (name, value)
                else:
                    assert got == expected, (name, value)
                checked += 1
    assert checked > 0 or not _checks(cls)


def test_a_string_of_a_closed_set_becomes_its_member_and_a_wrong_one_names_the_values():
    from epochal.protocol import Phase, Status

    status = Status(phase="validate", epoch=0, step=0, where="")  # type: ignore[arg-type]
    assert status.phase is Phase.VALIDATE
    with pytest.raises(ValueError, match=r"phase must be one of rendezvous, .*; got 'trian'"):
        Status(phase="trian", epoch=0, step=0, where="")  # type: ignore[arg-type]
