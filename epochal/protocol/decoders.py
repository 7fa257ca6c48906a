"""One decoder per record class, compiled once from its declared fields.

:func:`decoder` turns a class's :class:`~epochal.protocol.registry.FieldSpec` list into a
converter per field that checks the raw msgpack value's type and builds the field's value,
naming the path of what is wrong. :mod:`epochal.protocol.codec` runs a whole-frame unpack
through them; :mod:`epochal.protocol.reader` runs its value-by-value reads through the same.

A map may leave out a field declared with a default (the record takes the default) and may carry
fields this version does not know, written by a peer of a newer minor version: their values are
checked against the bounds of :mod:`epochal.protocol.limits` (:class:`Budget`), never built into
anything, and their paths are collected for the caller to log.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

from epochal.errors import MalformedMessage
from epochal.protocol.limits import (
    MAX_DEPTH,
    MAX_FIELDS,
    MAX_KEY_CHARS,
    MAX_LIST_ITEMS,
    MAX_SKIPPED_VALUES,
    SESSION_KEY,
    TYPE_KEY,
    VERSION_KEY,
)
from epochal.protocol.registry import FieldSpec, Record, fields_of


class _Skipped:
    def __repr__(self) -> str:
        return "<skipped>"


SKIPPED = _Skipped()
"""What the value-by-value reader keeps of a field it does not know: its value was read within
the bounds and dropped."""


class Budget:
    """How many more values the unknown fields of one map may hold (:data:`MAX_SKIPPED_VALUES`):
    the value-by-value reader spends it as it reads past each value, the whole-frame path in
    :meth:`within`."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = MAX_SKIPPED_VALUES

    def spend(self, where: str) -> None:
        """Count one more value of an unknown field, or MalformedMessage past the budget."""
        self.left -= 1
        if self.left < 0:
            raise MalformedMessage(
                f"{where}: the fields of one map that this version does not know hold over "
                f"{MAX_SKIPPED_VALUES} values"
            )

    def within(self, value: Any) -> bool:
        """Whether ``value`` (unpacked whole) is one the reader skips: plain values, and lists and
        maps of them within :data:`MAX_LIST_ITEMS`, :data:`MAX_FIELDS` (string keys of at most
        :data:`MAX_KEY_CHARS`) and :data:`MAX_DEPTH`, holding at most the values left."""
        todo = [(value, 0)]
        while todo:
            value, depth = todo.pop()
            self.left -= 1
            if self.left < 0:
                return False
            kind = type(value)
            if kind is list:
                if depth >= MAX_DEPTH or len(value) > MAX_LIST_ITEMS:
                    return False
                todo.extend((v, depth + 1) for v in value)
            elif kind is dict:
                if depth >= MAX_DEPTH or len(value) > MAX_FIELDS:
                    return False
                for k, v in value.items():
                    if type(k) is not str or len(k) > MAX_KEY_CHARS:
                        return False
                    todo.append((v, depth + 1))
            elif not (value is None or kind in (str, int, float, bool)):
                return False
        return True


def skip(skipped: list[str], value: Any, where: str, budget: Budget) -> None:
    """Skip the unknown field at ``where``, adding its path to ``skipped``: its value (unpacked
    whole, or SKIPPED when the reader read past it, spending ``budget``) must be one the reader
    skips, within the ``budget`` of its map, else MalformedMessage."""
    if value is not SKIPPED and not budget.within(value):
        raise MalformedMessage(f"{where}: not a value an unknown field may hold")
    skipped.append(where)


Converter = Callable[[Any, str, "str | int", list[str]], Any]
"""Checks one raw value (as msgpack gives it) of a declared field and returns the field's value.
Called with the value, the path of its container and its key there (a field name or list index),
which name it in the MalformedMessage it raises, and the list of the frame's skipped fields."""


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

    def nilable(value: Any, parent: str, key: str | int, skipped: list[str]) -> Any:
        return None if value is None else convert(value, parent, key, skipped)

    return nilable


def _plain_converter(spec: FieldSpec) -> Converter:
    kind = spec.kind
    if kind is int:

        def to_int(value: Any, parent: str, key: str | int, skipped: list[str]) -> Any:
            if type(value) is int:
                return value
            raise _wrong("int", value, parent, key)

        return to_int
    if kind is float:

        def to_float(value: Any, parent: str, key: str | int, skipped: list[str]) -> Any:
            if type(value) is float:
                return value
            if type(value) is int:
                return float(value)
            raise _wrong("float", value, parent, key)

        return to_float
    if kind is bool:

        def to_bool(value: Any, parent: str, key: str | int, skipped: list[str]) -> Any:
            if type(value) is bool:
                return value
            raise _wrong("bool", value, parent, key)

        return to_bool
    if kind is str:

        def to_str(value: Any, parent: str, key: str | int, skipped: list[str]) -> Any:
            if type(value) is str:
                return value
            raise _wrong("str", value, parent, key)

        return to_str
    if kind is tuple:
        assert spec.item is not None
        item = _converter(spec.item)
        most = spec.max_items

        def to_tuple(value: Any, parent: str, key: str | int, skipped: list[str]) -> Any:
            if type(value) is not list:
                raise _wrong("a list", value, parent, key)
            where = _path(parent, key)
            if len(value) > most:
                raise MalformedMessage(
                    f"{where}: a list of {len(value)} items, at most {most} allowed"
                )
            return tuple([item(v, where, i, skipped) for i, v in enumerate(value)])

        return to_tuple
    if issubclass(kind, Record):
        record = kind

        def to_record(value: Any, parent: str, key: str | int, skipped: list[str]) -> Any:
            return decoder(record).build(value, _path(parent, key), skipped)

        return to_record
    members: dict[str, Any] = dict(typing.cast(Any, kind)._value2member_map_)  # a StrEnum
    allowed = ", ".join(members)

    def to_member(value: Any, parent: str, key: str | int, skipped: list[str]) -> Any:
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
        self.required = tuple(spec.name for spec in self.specs if spec.required)
        # what a field left out stands for (a required one is never left out)
        self.defaults = tuple(spec.default for spec in self.specs)
        # the keys of a whole frame of this message with every field, without and with a session
        self.frame_keys = self.keys | {VERSION_KEY, TYPE_KEY}
        self.frame_keys_session = self.frame_keys | {SESSION_KEY}
        self.by_name = {spec.name: spec for spec in self.specs}
        # whether the record holds maps of its own (a hello's fingerprint and its params)
        self.nested = any(_holds_record(spec) for spec in self.specs)

    def build(self, raw: Any, where: str, skipped: list[str]) -> Any:
        """The record from its raw map, or MalformedMessage naming every missing field at once,
        else the first wrong value by its path. A field left out takes its default; a field this
        version does not know goes to ``skipped``."""
        if type(raw) is not dict:
            raise MalformedMessage(f"{where}: expected a map, got {type(raw).__name__}")
        if raw.keys() == self.keys:  # every field and nothing else: a peer of this version
            values = [convert(raw[n], where, n, skipped) for n, convert in self.converters]
        else:
            values = self._values(raw, where, skipped)
        return self.make(values, where)

    def _values(self, raw: dict[Any, Any], where: str, skipped: list[str]) -> list[Any]:
        if len(raw) > MAX_FIELDS:
            raise MalformedMessage(
                f"{where}: a map of {len(raw)} entries, at most {MAX_FIELDS} allowed"
            )
        unknown = [name for name in raw if name not in self.keys]
        missing = [name for name in self.required if name not in raw]
        if missing:
            known = f" (it has {', '.join(map(repr, unknown))}, not fields of this version)"
            raise MalformedMessage(
                f"{where}: missing {', '.join(missing)}{known if unknown else ''}"
            )
        budget = Budget()
        for name in unknown:
            if type(name) is not str or len(name) > MAX_KEY_CHARS:
                raise MalformedMessage(
                    f"{where}: a field name must be a string of at most {MAX_KEY_CHARS} characters"
                )
            skip(skipped, raw[name], f"{where}.{name}", budget)
        return [
            convert(raw[name], where, name, skipped) if name in raw else default
            for (name, convert), default in zip(self.converters, self.defaults, strict=True)
        ]

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
