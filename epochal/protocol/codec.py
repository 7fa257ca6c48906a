"""Bytes to messages and back: msgpack with bounded, field-by-field validated decoding.

A frame is one msgpack map ``{"v": PROTOCOL_VERSION, "t": <type name>, <field>: <value>, ...}``.
:func:`decode` returns exactly one message of :mod:`epochal.protocol.messages` or raises
:class:`~epochal.errors.MalformedMessage`; nothing else escapes it, whatever the bytes.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from typing import Any

import msgpack

from epochal.errors import MalformedMessage, ProtocolVersionMismatch
from epochal.protocol.messages import (
    MAX_FRAME_BYTES,
    MAX_PARAMS,
    MAX_TEXT_CHARS,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    TYPE_NAMES,
    Message,
)

_RESERVED = ("v", "t")


def encode(message: Message) -> bytes:
    """Encode one message as a frame."""
    name = TYPE_NAMES.get(type(message))
    if name is None:
        raise TypeError(f"{type(message).__name__} is not a protocol message")
    frame: dict[str, Any] = {"v": PROTOCOL_VERSION, "t": name}
    frame.update(_plain(message))
    data: bytes = msgpack.packb(frame, use_bin_type=True)
    if len(data) > MAX_FRAME_BYTES:
        raise ValueError(f"{name} message is {len(data)} bytes, over the {MAX_FRAME_BYTES} limit")
    return data


def decode(data: bytes) -> Message:
    """Decode one frame, or raise MalformedMessage naming what is wrong with it."""
    if len(data) > MAX_FRAME_BYTES:
        raise MalformedMessage(f"frame of {len(data)} bytes is over the {MAX_FRAME_BYTES} limit")
    try:
        frame = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_TEXT_CHARS * 4,
            max_bin_len=0,
            max_array_len=MAX_PARAMS,
            max_map_len=64,
            max_ext_len=0,
            use_list=True,
        )
    except Exception as exc:  # msgpack raises a zoo of types on bad input; all mean the same
        raise MalformedMessage(f"not a msgpack frame: {type(exc).__name__}: {exc}") from None
    if not isinstance(frame, dict):
        raise MalformedMessage(f"frame is a {type(frame).__name__}, expected a map")
    version = frame.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolVersionMismatch(
            f"peer speaks protocol version {version!r}, this process speaks {PROTOCOL_VERSION}: "
            "install the same epochal version on the coordinator and every worker",
            theirs=version,
            ours=PROTOCOL_VERSION,
        )
    name = frame.get("t")
    cls = MESSAGE_TYPES.get(name) if isinstance(name, str) else None
    if cls is None or not isinstance(name, str):
        raise MalformedMessage(f"unknown message type {name!r}")
    fields = {k: v for k, v in frame.items() if k not in _RESERVED}
    message = _build(cls, fields, name)
    return typing.cast(Message, message)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _build(cls: type, fields: Any, where: str) -> Any:
    if not isinstance(fields, dict):
        raise MalformedMessage(f"{where}: expected a map, got {type(fields).__name__}")
    hints = _hints(cls)
    expected = [f.name for f in dataclasses.fields(cls)]
    missing = [n for n in expected if n not in fields]
    extra = [n for n in fields if n not in hints]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing)}")
        if extra:
            parts.append(f"unexpected {', '.join(map(repr, extra))}")
        raise MalformedMessage(f"{where}: {'; '.join(parts)}")
    values = {n: _coerce(fields[n], hints[n], f"{where}.{n}") for n in expected}
    try:
        return cls(**values)
    except ValueError as exc:
        raise MalformedMessage(f"{where}: {exc}") from None


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is types.UnionType or origin is typing.Union:
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        inner = [o for o in options if o is not type(None)]
        return _coerce(value, inner[0], where)
    if origin is tuple:
        item_type = typing.get_args(tp)[0]
        if not isinstance(value, list):
            raise MalformedMessage(f"{where}: expected a list, got {type(value).__name__}")
        return tuple(_coerce(v, item_type, f"{where}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        return _build(typing.cast(type, tp), value, where)
    if isinstance(tp, type) and issubclass(tp, enum.StrEnum):
        allowed = [member.value for member in tp]
        if isinstance(value, str) and value in allowed:
            return tp(value)
        raise MalformedMessage(f"{where}: expected one of {', '.join(allowed)}, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - a message declared a type this codec does not know
        raise TypeError(f"{where}: codec cannot handle {tp!r}")
    raise MalformedMessage(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
