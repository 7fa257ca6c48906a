"""The registry of messages: :func:`message` makes a class a message, and what each field declares.

A message is a frozen dataclass deriving from :class:`WorkerMessage` or :class:`CoordinatorMessage`
and decorated with :func:`message`, which registers it under its wire name
(:data:`MESSAGE_TYPES`, :data:`TYPE_NAMES`). :func:`fields_of` reads each field's declared type
into a :class:`FieldSpec`: its kind, whether None is allowed, its constraints
(:mod:`epochal.protocol.constraints`), a list's bound and its default. The codec decodes a frame
straight into the class with msgspec, which reads the class's annotations: :func:`fields_of`
sets each one to :func:`wire_type`, the declared type with the constraints msgspec can enforce as
its ``msgspec.Meta``. A field the codec could not carry, or a list without a declared bound, is a
TypeError where its message is declared.

This module's imports are private (underscored): ``from epochal.protocol.registry import *``
exports exactly the protocol's names.
"""

import dataclasses as _dataclasses
import enum as _enum
import re as _re
import types as _types
import typing as _typing
from collections.abc import Callable as _Callable
from typing import Annotated as _Annotated
from typing import Any as _Any

import msgspec as _msgspec

from epochal.protocol import compiledchecks as _compiledchecks
from epochal.protocol import constraints as _constraints
from epochal.protocol import limits as _limits


@_dataclasses.dataclass(frozen=True, slots=True)
class FieldSpec:
    """One field of a record as its declared type describes it; the codec compiles these."""

    name: str
    kind: type
    # int, float, bool, str, a StrEnum, tuple (then ``item`` and ``max_items``) or a Record
    nilable: bool
    # None is a value of this field
    constraints: tuple[_constraints.Constraint, ...]
    item: "FieldSpec | None" = None
    # the type of a tuple's items
    max_items: int = 0
    # most items of a tuple, as its type declares it (Items)
    required: bool = True
    # every frame must carry the field: it has no default
    default: _Any = None
    # otherwise the value a frame that leaves the field out stands for


def _spec(owner: str, name: str, tp: _Any) -> FieldSpec:
    where = f"{owner}.{name}"
    nilable = False
    if _typing.get_origin(tp) in (_typing.Union, _types.UnionType):
        options = [o for o in _typing.get_args(tp) if o is not type(None)]
        if len(options) != 1:
            raise TypeError(f"{where}: only X | None unions are supported, got {tp!r}")
        nilable, tp = True, options[0]
    constraints: list[_constraints.Constraint] = []
    if _typing.get_origin(tp) is _Annotated:
        tp, *metadata = _typing.get_args(tp)
        # the msgspec.Meta that wire_type added is derived from the rest, not declared
        constraints.extend(m for m in metadata if not isinstance(m, _msgspec.Meta))
    bounds = [c for c in constraints if isinstance(c, _constraints.Items)]
    if _typing.get_origin(tp) is tuple:
        if len(bounds) != 1:
            raise TypeError(
                f"{where}: a list field declares its bound on its type, once: "
                "Annotated[tuple[X, ...], Items(MAX_...)]"
            )
        item = _spec(owner, name, _typing.get_args(tp)[0])
        return FieldSpec(name, tuple, nilable, tuple(constraints), item, bounds[0].most)
    if bounds:
        raise TypeError(f"{where}: Items bounds a list, not {tp!r}")
    if isinstance(tp, type) and issubclass(tp, _enum.StrEnum):
        if _constraints.OneOf(tp) not in constraints:  # wire_type's annotation holds it already
            constraints.insert(0, _constraints.OneOf(tp))
        return FieldSpec(name, tp, nilable, tuple(constraints))
    if isinstance(tp, type) and issubclass(tp, Record):
        fields_of(tp)  # a nested record's own fields fail here, where its user is declared
        return FieldSpec(name, tp, nilable, tuple(constraints))
    if tp in (int, float, bool, str):
        return FieldSpec(name, tp, nilable, tuple(constraints))
    raise TypeError(f"{where}: a message field cannot be of type {tp!r}")


def wire_type(spec: FieldSpec) -> _Any:
    """The type msgspec decodes a field as: its declared type and constraints, a list's with its
    bound once more as msgspec's ``max_length``, so that a longer list is refused from its header
    (naming its path) before any item is built. The other constraints run in the record's
    ``__post_init__``, which msgspec calls on every record it builds; a StrEnum field is read as
    its string, which :class:`~epochal.protocol.constraints.OneOf` then checks and turns into its
    member, saying which values it may take."""
    extra: list[_Any] = []
    if spec.kind is tuple:
        assert spec.item is not None
        tp: _Any = tuple[wire_type(spec.item), ...]  # type: ignore[misc]
        extra.append(_msgspec.Meta(max_length=spec.max_items))
    elif isinstance(spec.kind, type) and issubclass(spec.kind, _enum.StrEnum):
        tp = str
    else:
        tp = spec.kind
    if spec.constraints or extra:
        tp = _Annotated[(tp, *spec.constraints, *extra)]
    return tp | None if spec.nilable else tp


_FIELDS: dict[type, tuple[FieldSpec, ...]] = {}
_DECLARED: dict[type, dict[str, _Any]] = {}
# each record's annotations as declared, before fields_of set them to their wire types


def fields_of(cls: type) -> tuple[FieldSpec, ...]:
    """The declared fields of a record (message or part), in order."""
    found = _FIELDS.get(cls)
    if found is None:
        hints = _DECLARED.setdefault(cls, _typing.get_type_hints(cls, include_extras=True))
        specs = []
        for f in _dataclasses.fields(cls):
            if f.default_factory is not _dataclasses.MISSING:
                raise TypeError(
                    f"{cls.__name__}.{f.name}: give the field a default value, not a factory "
                    "(a frame that leaves the field out stands for that value)"
                )
            spec = _spec(cls.__name__, f.name, hints[f.name])
            if f.default is not _dataclasses.MISSING:
                spec = _dataclasses.replace(spec, required=False, default=f.default)
            specs.append(spec)
        if len(specs) > _limits.MAX_FIELDS:
            raise TypeError(f"{cls.__name__}: a record has at most {_limits.MAX_FIELDS} fields")
        found = _FIELDS[cls] = tuple(specs)
        for spec in found:  # what msgspec reads when it builds a decoder of the class
            cls.__annotations__[spec.name] = wire_type(spec)
    return found


_Checks = _compiledchecks.Checks
_CHECKS: dict[type, _Checks] = {}
_COMPILED: dict[type, _Callable[[_Any], None]] = {}
# each record class's checks as one function (see epochal.protocol.compiledchecks)


def _checks(cls: type) -> _Checks:
    """The constrained fields of ``cls``: name, whether None is allowed, the constraints."""
    found = _CHECKS.get(cls)
    if found is None:
        found = _CHECKS[cls] = tuple(
            (spec.name, spec.nilable, spec.constraints)
            for spec in fields_of(cls)
            if spec.constraints
        )
    return found


class Record:
    """A frozen dataclass whose fields' constraints are declared on their types."""

    __slots__ = ()

    def __post_init__(self) -> None:
        cls = type(self)
        check = _COMPILED.get(cls)
        if check is None:  # the first record of its class: its checks compiled once
            check = _COMPILED[cls] = _compiledchecks.compile_checks(cls.__name__, _checks(cls))
        check(self)

    def _validate(self) -> None:
        """Checks between fields; raises ValueError. Each field's own check is on its type."""


class Message(Record):
    """Any control message.

    A message type added within a major version is ``optional``: a peer sends it only to a peer
    that listed it among the optional types it understands (``Hello.understands``,
    ``Welcome.understands``), so that peers of the major version's other minor versions never
    receive a type they do not know."""

    __slots__ = ()
    optional: _typing.ClassVar[bool] = False


class WorkerMessage(Message):
    """A message a worker sends to the coordinator."""

    __slots__ = ()


class CoordinatorMessage(Message):
    """A message the coordinator sends to a worker."""

    __slots__ = ()


OPTIONAL_TYPES: set[str] = set()
"""Wire names of the optional message types (:attr:`Message.optional`), filled by
:func:`message`."""


def understood() -> tuple[str, ...]:
    """The optional message types this process understands, as its hello or welcome lists them."""
    return tuple(sorted(OPTIONAL_TYPES))


MESSAGE_TYPES: dict[str, type[Message]] = {}
"""Wire name of every message type, filled by :func:`message`; the codec refuses any other."""

TYPE_NAMES: dict[type, str] = {}
"""Each message class's wire name."""

_M = _typing.TypeVar("_M", bound=Message)


def wire_name(class_name: str) -> str:
    """The wire name of a message class: its name in snake case (``OpenStore``: ``open_store``)."""
    return _re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", class_name).lower()


@_typing.dataclass_transform(frozen_default=True)
def message(cls: type[_M]) -> type[_M]:
    """Make ``cls`` a frozen dataclass and register it as the message named after it."""
    if not issubclass(cls, WorkerMessage | CoordinatorMessage):
        raise TypeError(f"{cls.__name__} must derive from WorkerMessage or CoordinatorMessage")
    made = _dataclasses.dataclass(frozen=True, slots=True)(cls)
    # a field of a type the codec cannot carry, or a list without its bound, fails here
    specs = fields_of(made)
    clash = [spec.name for spec in specs if spec.name in _limits.FRAME_KEYS]
    if clash:
        raise TypeError(f"{cls.__name__}: {', '.join(clash)} is a frame's own key, not a field")
    name = wire_name(cls.__name__)
    if name in MESSAGE_TYPES:
        raise TypeError(f"two messages are named {name!r}")
    MESSAGE_TYPES[name] = made
    TYPE_NAMES[made] = name
    if made.optional:
        OPTIONAL_TYPES.add(name)
    return made


def names_sent_by(sender: type[Message]) -> tuple[str, ...]:
    """Wire names of the messages ``sender`` (WorkerMessage or CoordinatorMessage) may send."""
    return tuple(name for name, cls in MESSAGE_TYPES.items() if issubclass(cls, sender))
