"""One decoder per record class, compiled once from its declared fields.

:func:`decoder` turns a class's :class:`~epochal.protocol.records.FieldSpec` list into a
converter per field that checks the raw msgpack value's type and builds the field's value,
naming the path of what is wrong. :mod:`epochal.protocol.codec` runs a whole-frame unpack
through them; :mod:`epochal.protocol.reader` runs its value-by-value reads through the same.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

from epochal.errors import MalformedMessage
from epochal.protocol.limits import (
    LIST_LIMITS,
    SESSION_KEY,
)
from epochal.protocol.messages import (
    FieldSpec,
    Record,
    fields_of,
)

RESERVED = ("v", "t")

Converter = Callable[[Any, str, "str | int"], Any]
"""Checks one raw value (as msgpack gives it) of a declared field and returns the field's value.
Called with the value, the path of its container and its key there (a field name or list index),
which name it in the MalformedMessage it raises."""


def _path(parent: str, key: str | int) -> str:
    return f"{parent}[{key}]" if isinstance(key, int) else f"{parent}.{key}"


def _wrong(expected: str, value: Any, parent: str, key: str | int) -> MalformedMessage:
    return MalformedMessage(
        f"{_path(parent, key)}: expected {expected}, got {type(value).__name__}"
    )


# ------------------------------------------------------------------------ compiled decoders


def _converter(spec: FieldSpec) -> Converter:
    convert = _plain_converter(spec)
    if not spec.nilable:
        return convert

    def nilable(value: Any, parent: str, key: str | int) -> Any:
        return None if value is None else convert(value, parent, key)

    return nilable


def _plain_converter(spec: FieldSpec) -> Converter:
    kind = spec.kind
    if kind is int:

        def to_int(value: Any, parent: str, key: str | int) -> Any:
            if type(value) is int:
                return value
            raise _wrong("int", value, parent, key)

        return to_int
    if kind is float:

        def to_float(value: Any, parent: str, key: str | int) -> Any:
            if type(value) is float:
                return value
            if type(value) is int:
                return float(value)
            raise _wrong("float", value, parent, key)

        return to_float
    if kind is bool:

        def to_bool(value: Any, parent: str, key: str | int) -> Any:
            if type(value) is bool:
                return value
            raise _wrong("bool", value, parent, key)

        return to_bool
    if kind is str:

        def to_str(value: Any, parent: str, key: str | int) -> Any:
            if type(value) is str:
                return value
            raise _wrong("str", value, parent, key)

        return to_str
    if kind is tuple:
        assert spec.item is not None
        item = _converter(spec.item)
        most = LIST_LIMITS.get(spec.name, 0)

        def to_tuple(value: Any, parent: str, key: str | int) -> Any:
            if type(value) is not list:
                raise _wrong("a list", value, parent, key)
            where = _path(parent, key)
            if len(value) > most:
                raise MalformedMessage(
                    f"{where}: a list of {len(value)} items, at most {most} allowed"
                )
            return tuple([item(v, where, i) for i, v in enumerate(value)])

        return to_tuple
    if issubclass(kind, Record):
        record = kind

        def to_record(value: Any, parent: str, key: str | int) -> Any:
            return decoder(record).build(value, _path(parent, key))

        return to_record
    members: dict[str, Any] = dict(typing.cast(Any, kind)._value2member_map_)  # a StrEnum
    allowed = ", ".join(members)

    def to_member(value: Any, parent: str, key: str | int) -> Any:
        if type(value) is str and value in members:
            return members[value]
        raise MalformedMessage(f"{_path(parent, key)}: expected one of {allowed}, got {value!r}")

    return to_member


class Decoder:
    """Builds one record class from the raw map msgpack gives for it."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.specs = fields_of(cls)
        self.names = tuple(spec.name for spec in self.specs)
        self.converters = tuple((spec.name, _converter(spec)) for spec in self.specs)
        self.keys = frozenset(self.names)
        # the keys of a whole frame of this message, without and with a session
        self.frame_keys = self.keys | set(RESERVED)
        self.frame_keys_session = self.frame_keys | {SESSION_KEY}
        self.by_name = {spec.name: spec for spec in self.specs}
        # whether the record holds maps of its own (a hello's fingerprint and its params)
        self.nested = any(_holds_record(spec) for spec in self.specs)

    def build(self, raw: Any, where: str) -> Any:
        """The record from its raw map, or MalformedMessage naming every missing or extra field
        at once, else the first wrong value by its path."""
        if type(raw) is not dict:
            raise MalformedMessage(f"{where}: expected a map, got {type(raw).__name__}")
        if raw.keys() != self.keys:
            parts = []
            missing = [n for n in self.names if n not in raw]
            extra = [n for n in raw if n not in self.keys]
            if missing:
                parts.append(f"missing {', '.join(missing)}")
            if extra:
                parts.append(f"unexpected {', '.join(map(repr, extra))}")
            raise MalformedMessage(f"{where}: {'; '.join(parts)}")
        return self.make([convert(raw[n], where, n) for n, convert in self.converters], where)

    def make(self, values: list[Any], where: str) -> Any:
        try:
            return self.cls(*values)
        except ValueError as exc:
            raise MalformedMessage(f"{where}: {exc}") from None


def _holds_record(spec: FieldSpec) -> bool:
    if spec.item is not None:
        return _holds_record(spec.item)
    return issubclass(spec.kind, Record)


DECODERS: dict[type, Decoder] = {}


def decoder(cls: type) -> Decoder:
    """The decoder of a record class, compiled on first use."""
    found = DECODERS.get(cls)
    if found is None:
        found = DECODERS[cls] = Decoder(cls)
    return found
