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
from epochal.protocol.limits import (
    LIST_LIMITS,
    MAX_FIELDS,
    MAX_FRAME_OBJECTS,
    MAX_KEY_CHARS,
    SESSION_KEY,
)
from epochal.protocol.messages import (
    MAX_FRAME_BYTES,
    MAX_SESSION_CHARS,
    MAX_TEXT_CHARS,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    TYPE_NAMES,
    Message,
)

_RESERVED = ("v", "t")


def encode(message: Message, session: str = "") -> bytes:
    """Encode one message as a frame; a worker's frames after its hello carry its ``session``."""
    name = TYPE_NAMES.get(type(message))
    if name is None:
        raise TypeError(f"{type(message).__name__} is not a protocol message")
    if len(session) > MAX_SESSION_CHARS:
        raise ValueError(f"a session is at most {MAX_SESSION_CHARS} characters")
    frame: dict[str, Any] = {"v": PROTOCOL_VERSION, "t": name}
    if session:
        frame[SESSION_KEY] = session
    frame.update(_plain(message))
    data: bytes = msgpack.packb(frame, use_bin_type=True)
    if len(data) > MAX_FRAME_BYTES:
        raise ValueError(f"{name} message is {len(data)} bytes, over the {MAX_FRAME_BYTES} limit")
    return data


def decode(data: bytes | memoryview) -> Message:
    """Decode one frame, or raise MalformedMessage naming what is wrong with it."""
    return decode_frame(data)[0]


def decode_frame(data: bytes | memoryview) -> tuple[Message, str]:
    """Decode one frame into its message and the session it presents ("" when none).

    The frame is read against the message's declared fields, value by value, and every container
    is refused before its items are read when it is not where the message has one or is longer than
    the message allows: whatever the bytes, decoding allocates at most about what the largest
    legitimate message needs (at most :data:`MAX_FRAME_OBJECTS` values), never an amplification.
    """
    size = memoryview(data).nbytes
    if size > MAX_FRAME_BYTES:
        raise MalformedMessage(f"frame of {size} bytes is over the {MAX_FRAME_BYTES} limit")
    reader = _Reader(data)
    try:
        message, session = reader.frame()
        if reader.unpacker.tell() != size:
            raise MalformedMessage("not a msgpack frame: extra bytes after the frame's map")
    except (MalformedMessage, ProtocolVersionMismatch):
        raise
    except Exception as exc:  # msgpack raises a zoo of types on bad input; all mean the same
        raise MalformedMessage(f"not a msgpack frame: {type(exc).__name__}: {exc}") from None
    return typing.cast(Message, message), session


def _kind(byte: int) -> str:
    """What a msgpack value starting with ``byte`` is, by its first byte alone."""
    if byte <= 0x7F or byte >= 0xE0 or 0xCC <= byte <= 0xD3:
        return "int"
    if 0x80 <= byte <= 0x8F or byte in (0xDE, 0xDF):
        return "map"
    if 0x90 <= byte <= 0x9F or byte in (0xDC, 0xDD):
        return "list"
    if 0xA0 <= byte <= 0xBF or byte in (0xD9, 0xDA, 0xDB):
        return "str"
    if byte == 0xC0:
        return "NoneType"
    if byte in (0xC2, 0xC3):
        return "bool"
    if byte in (0xCA, 0xCB):
        return "float"
    if byte in (0xC4, 0xC5, 0xC6):
        return "bytes"
    return "ext"  # 0xc1 (never used) and the ext types


READ_CHUNK = 64 * 1024
"""Bytes the reader copies out of a frame at a time: it never copies a whole 16 MiB frame."""


class _Stream:
    """A frame's buffer as the file the unpacker reads from, a chunk at a time, without copying
    the whole frame (the caller may pass a view of the received message itself)."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.pos = 0

    def read(self, n: int) -> bytes:
        chunk = self.view[self.pos : self.pos + n]
        self.pos += len(chunk)
        return bytes(chunk)


class _Reader:
    """Reads one frame from the front, one declared value at a time."""

    def __init__(self, data: bytes | memoryview) -> None:
        self.data = memoryview(data).cast("B")
        self.unpacker = msgpack.Unpacker(
            _Stream(self.data),
            raw=False,
            strict_map_key=True,
            read_size=READ_CHUNK,
            max_buffer_size=MAX_TEXT_CHARS * 4 + 2 * READ_CHUNK,
            max_str_len=MAX_TEXT_CHARS * 4,
            max_bin_len=0,
            max_array_len=0,
            max_map_len=0,
            max_ext_len=0,
        )
        self.objects = 0

    def peek(self) -> str:
        at = self.unpacker.tell()
        if at >= len(self.data):
            raise MalformedMessage("not a msgpack frame: it ends in the middle of a value")
        self.objects += 1
        if self.objects > MAX_FRAME_OBJECTS:
            raise MalformedMessage(f"frame holds more than {MAX_FRAME_OBJECTS} values")
        byte = self.data[at]
        if byte == 0xC1:
            raise MalformedMessage("not a msgpack frame: byte 0xc1 is never used by msgpack")
        return _kind(byte)

    def scalar(self, where: str) -> Any:
        kind = self.peek()
        if kind in ("map", "list", "bytes", "ext"):
            raise MalformedMessage(f"{where}: expected a plain value, got {_KIND_NAMES[kind]}")
        return self.unpacker.unpack()

    def key(self, where: str) -> str:
        kind = self.peek()
        if kind != "str":
            raise MalformedMessage(
                f"{where}: a field name must be a string, got {_KIND_NAMES[kind]}"
            )
        name = self.unpacker.unpack()
        if len(name) > MAX_KEY_CHARS:
            raise MalformedMessage(
                f"{where}: a field name is longer than {MAX_KEY_CHARS} characters"
            )
        return typing.cast(str, name)

    def map_header(self, where: str, most: int) -> int:
        kind = self.peek()
        if kind != "map":
            raise MalformedMessage(f"{where}: expected a map, got {_KIND_NAMES[kind]}")
        n = int(self.unpacker.read_map_header())
        if n > most:
            raise MalformedMessage(f"{where}: a map of {n} entries, at most {most} allowed")
        return n

    def frame(self) -> tuple[Any, str]:
        kind = self.peek()
        if kind != "map":
            raise MalformedMessage(f"frame is a {_KIND_NAMES[kind]}, expected a map")
        n = int(self.unpacker.read_map_header())
        if n > MAX_FIELDS + len(_RESERVED) + 1:
            raise MalformedMessage(f"frame is a map of {n} entries, more than any message has")
        head: dict[str, Any] = {}
        for _ in range(min(n, 2)):  # "v" and "t" come first, so the rest is read by its schema
            name = self.key("frame")
            if name not in _RESERVED or name in head:
                break
            if name == "t" and self.peek() in ("map", "list"):
                raise MalformedMessage("unknown message type: a container, not a name")
            head[name] = self.scalar(f"frame.{name}")
        else:
            name = None
        version = head.get("v")
        if type(version) is not int or version != PROTOCOL_VERSION:
            raise ProtocolVersionMismatch(
                f"peer speaks protocol version {version!r}, this process speaks "
                f"{PROTOCOL_VERSION}: install the same epochal version on the coordinator and "
                "every worker",
                theirs=version,
                ours=PROTOCOL_VERSION,
            )
        type_name = head.get("t")
        cls = MESSAGE_TYPES.get(type_name) if isinstance(type_name, str) else None
        if cls is None or not isinstance(type_name, str):
            raise MalformedMessage(f"unknown message type {type_name!r}")
        session = ""
        fields: dict[str, Any] = {}
        for i in range(n - len(head)):
            if i > 0 or name is None:
                name = self.key(type_name)
            if name == SESSION_KEY and not session:
                value = self.scalar(f"{type_name}.{name}")
                if not isinstance(value, str) or not 0 < len(value) <= MAX_SESSION_CHARS:
                    raise MalformedMessage(
                        f"{type_name}: the session must be a string of 1-{MAX_SESSION_CHARS} "
                        "characters"
                    )
                session = value
            else:
                self.field(cls, fields, name, type_name)
        return _build(cls, fields, type_name), session

    def field(self, cls: type, fields: dict[str, Any], name: str, where: str) -> None:
        """Read the value of field ``name`` of ``cls`` into ``fields``."""
        tp = _hints(cls).get(name)
        if name in fields:
            raise MalformedMessage(f"{where}: field {name!r} appears twice")
        if tp is None:
            # an unknown field is named with the others by _build; its value is read only when
            # it is a plain value, so no unknown field makes the decoder build a structure
            if self._next_kind() in ("map", "list"):
                raise MalformedMessage(f"{where}: unexpected {name!r}")
            fields[name] = self.scalar(f"{where}.{name}")
            return
        fields[name] = self.value(tp, f"{where}.{name}")

    def value(self, tp: Any, where: str) -> Any:
        """One raw value of declared type ``tp``: containers only where ``tp`` has them."""
        origin = typing.get_origin(tp)
        if origin is types.UnionType or origin is typing.Union:
            options = typing.get_args(tp)
            if type(None) in options and self._next_is_nil():
                return self.scalar(where)
            inner = [o for o in options if o is not type(None)]
            return self.value(inner[0], where)
        if origin is tuple:
            item_type = typing.get_args(tp)[0]
            kind = self.peek()
            if kind != "list":
                raise MalformedMessage(f"{where}: expected a list, got {_KIND_NAMES[kind]}")
            n = int(self.unpacker.read_array_header())
            most = _list_limit(where)
            if n > most:
                raise MalformedMessage(f"{where}: a list of {n} items, at most {most} allowed")
            return [self.value(item_type, f"{where}[{i}]") for i in range(n)]
        if dataclasses.is_dataclass(tp):
            cls = typing.cast(type, tp)
            n = self.map_header(where, len(_hints(cls)) + 1)
            fields: dict[str, Any] = {}
            for _ in range(n):
                self.field(cls, fields, self.key(where), where)
            return fields
        return self.scalar(where)

    def _next_kind(self) -> str:
        at = int(self.unpacker.tell())
        return _kind(self.data[at]) if at < len(self.data) else "end"

    def _next_is_nil(self) -> bool:
        at = int(self.unpacker.tell())
        return at < len(self.data) and self.data[at] == 0xC0


def _list_limit(where: str) -> int:
    """Most items the list at ``where`` (``hello.fingerprint.params[3].shape``) may hold."""
    name = where.rsplit(".", 1)[-1]
    return LIST_LIMITS.get(name, 0)


_KIND_NAMES = {
    "int": "int",
    "map": "dict",
    "list": "list",
    "str": "str",
    "NoneType": "NoneType",
    "bool": "bool",
    "float": "float",
    "bytes": "bytes",
    "ext": "an extension type",
}


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
