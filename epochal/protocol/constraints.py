"""Constraints declared on a field's type, and the field types the messages are made of.

A field's own check is written on its type, ``epoch: NonNeg`` (that is ``Annotated[int, Ge(0)]``),
``train_metrics: Annotated[tuple[Metric, ...], Items(MAX_METRICS)]``: the registry
(:mod:`epochal.protocol.registry`) reads it into the field's
:class:`~epochal.protocol.registry.FieldSpec`, and a record checks it whenever it is made, by its
sender as by the codec (msgspec calls the record's ``__post_init__`` on every record it builds).
A list's :class:`Items` is also handed to msgspec as the list's ``max_length``, so that a list
too long is refused from its header, before any of its items is built. Each constraint is called
with the field's name and value and returns the value (an enum member for a string, see
:class:`OneOf`) or raises ValueError saying what is wrong.

This module's imports are private (underscored): ``from epochal.protocol.constraints import *``
exports exactly the protocol's names.
"""

import dataclasses as _dataclasses
import enum as _enum
import math as _math
from collections.abc import Callable as _Callable
from typing import Annotated as _Annotated
from typing import Any as _Any

from epochal.protocol import limits as _limits
from epochal.protocol import strings as _strings

Constraint = _Callable[[str, _Any], _Any]
"""A check declared on a field's type: called with the field's name and value, it returns the value
(an enum member for a string, see :class:`OneOf`) or raises ValueError saying what is wrong."""


@_dataclasses.dataclass(frozen=True, slots=True)
class Ge:
    """The value is at least ``least``."""

    least: int

    def __call__(self, name: str, value: _Any) -> _Any:
        if not value >= self.least:
            raise ValueError(f"{name} must be >= {self.least}, got {value}")
        return value


@_dataclasses.dataclass(frozen=True, slots=True)
class Within:
    """The value lies in ``lowest..highest``."""

    lowest: int
    highest: int

    def __call__(self, name: str, value: _Any) -> _Any:
        if not self.lowest <= value <= self.highest:
            raise ValueError(f"{name} must be in {self.lowest}..{self.highest}, got {value}")
        return value


@_dataclasses.dataclass(frozen=True, slots=True)
class Finite:
    """The float is neither infinite nor NaN."""

    def __call__(self, name: str, value: _Any) -> _Any:
        if not _math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value}")
        return value


@_dataclasses.dataclass(frozen=True, slots=True)
class Chars:
    """The string is at most ``most`` characters, and not empty unless ``empty``."""

    empty: bool = False
    most: int = _limits.MAX_TEXT_CHARS

    def __call__(self, name: str, value: _Any) -> _Any:
        if len(value) > self.most:
            raise ValueError(f"{name} is longer than {self.most} characters")
        if not self.empty and value == "":
            raise ValueError(f"{name} must not be empty")
        return value


@_dataclasses.dataclass(frozen=True, slots=True)
class Length:
    """The string has ``least``..``most`` characters (sessions)."""

    least: int
    most: int

    def __call__(self, name: str, value: _Any) -> _Any:
        if not self.least <= len(value) <= self.most:
            raise ValueError(
                f"{name} must be {self.least}-{self.most} characters, got {len(value)}"
            )
        return value


@_dataclasses.dataclass(frozen=True, slots=True)
class OneOf:
    """The string is a value of ``choices``; the field then holds the enum member."""

    choices: type[_enum.StrEnum]

    def __call__(self, name: str, value: _Any) -> _Any:
        return _strings.one_of(self.choices, name, value)


@_dataclasses.dataclass(frozen=True, slots=True)
class Items:
    """The list holds at most ``most`` items: every list field declares one (``Annotated[tuple[X,
    ...], Items(n)]``, at most :data:`~epochal.protocol.limits.MAX_LIST_ITEMS`), and the codec
    refuses a longer list from its header, before it reads any item."""

    most: int

    def __post_init__(self) -> None:
        if not 0 <= self.most <= _limits.MAX_LIST_ITEMS:
            raise TypeError(
                f"Items({self.most}): a list holds 0..{_limits.MAX_LIST_ITEMS} items "
                "(MAX_LIST_ITEMS)"
            )

    def __call__(self, name: str, value: _Any) -> _Any:
        if len(value) > self.most:
            raise ValueError(f"{name} holds {len(value)} items, at most {self.most} allowed")
        return value


NonNeg = _Annotated[int, Ge(0)]
"""An int >= 0 (epochs, counts, pids)."""
Positive = _Annotated[int, Ge(1)]
"""An int >= 1 (world sizes, epoch counts)."""
Port = _Annotated[int, Within(1, 65535)]
"""A TCP port number."""
Text = _Annotated[str, Chars()]
"""A non-empty string of at most MAX_TEXT_CHARS characters (free text: reasons)."""
MaybeText = _Annotated[str, Chars(empty=True)]
"""A string of at most MAX_TEXT_CHARS characters, possibly empty."""
Name = _Annotated[str, Chars(most=_limits.MAX_NAME_CHARS)]
"""A non-empty string of at most MAX_NAME_CHARS characters."""
MaybeName = _Annotated[str, Chars(empty=True, most=_limits.MAX_NAME_CHARS)]
"""A string of at most MAX_NAME_CHARS characters, possibly empty."""
MaybePath = _Annotated[str, Chars(empty=True, most=_limits.MAX_PATH_CHARS)]
"""A path of at most MAX_PATH_CHARS characters, possibly empty."""
Session = _Annotated[str, Length(1, _limits.MAX_SESSION_CHARS)]
"""A worker's session secret."""
