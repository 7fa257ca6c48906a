"""Bytes to messages and back: msgpack with bounded, field-by-field validated decoding.

A frame is one msgpack map ``{"v": PROTOCOL_VERSION, "t": <type name>, <field>: <value>, ...}``.
:func:`decode` returns exactly one message of :mod:`epochal.protocol.messages` or raises
:class:`~epochal.errors.MalformedMessage`; nothing else escapes it, whatever the bytes.

Each record class gets one decoder, compiled once from its declared fields
(:func:`~epochal.protocol.messages.fields_of`): a converter per field that checks the raw value's
type and builds the field's value. A frame of at most
:data:`~epochal.protocol.limits.WHOLE_FRAME_BYTES` is unpacked whole and run through them; any
other frame, and any frame that fails there, is read value by value against the same declared
fields (never decoding a container the message does not have, nor a list longer than its field
allows) and run through the same converters, which name the path of what is wrong.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

import msgpack

from epochal.errors import MalformedMessage, ProtocolVersionMismatch
from epochal.protocol.limits import (
    LIST_LIMITS,
    MAX_FIELDS,
    MAX_FRAME_OBJECTS,
    MAX_KEY_CHARS,
    SESSION_KEY,
    WHOLE_FRAME_BYTES,
)
from epochal.protocol.messages import (
    MAX_FRAME_BYTES,
    MAX_PARAMS,
    MAX_SESSION_CHARS,
    MAX_TEXT_CHARS,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    TYPE_NAMES,
    FieldSpec,
    Message,
    Record,
    fields_of,
)

_RESERVED = ("v", "t")

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
        self.frame_keys = self.keys | set(_RESERVED)
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


_DECODERS: dict[type, Decoder] = {}


def decoder(cls: type) -> Decoder:
    """The decoder of a record class, compiled on first use."""
    found = _DECODERS.get(cls)
    if found is None:
        found = _DECODERS[cls] = Decoder(cls)
    return found


# ------------------------------------------------------------------------ encoding


def _encoder(spec: FieldSpec) -> Callable[[Any], Any] | None:
    """How a field's value becomes plain msgpack data; None: as it is (a StrEnum packs as its
    string, byte for byte)."""
    if spec.kind is tuple:
        assert spec.item is not None
        item = _encoder(spec.item)
        if item is None:
            return list
        return lambda value: None if value is None else [item(v) for v in value]
    if isinstance(spec.kind, type) and issubclass(spec.kind, Record):
        plain = _plain_record(spec.kind)
        return lambda value: None if value is None else plain(value)
    return None


def _plain_record(cls: type) -> Callable[[Any], dict[str, Any]]:
    parts = tuple((spec.name, _encoder(spec)) for spec in fields_of(cls))

    def plain(value: Any) -> dict[str, Any]:
        return {
            name: getattr(value, name) if enc is None else enc(getattr(value, name))
            for name, enc in parts
        }

    return plain


_ENCODERS: dict[type, Callable[[Any], dict[str, Any]]] = {}


def encode(message: Message, session: str = "") -> bytes:
    """Encode one message as a frame; a worker's frames after its hello carry its ``session``."""
    cls = type(message)
    name = TYPE_NAMES.get(cls)
    if name is None:
        raise TypeError(f"{cls.__name__} is not a protocol message")
    if len(session) > MAX_SESSION_CHARS:
        raise ValueError(f"a session is at most {MAX_SESSION_CHARS} characters")
    frame: dict[str, Any] = {"v": PROTOCOL_VERSION, "t": name}
    if session:
        frame[SESSION_KEY] = session
    plain = _ENCODERS.get(cls)
    if plain is None:
        plain = _ENCODERS[cls] = _plain_record(cls)
    frame.update(plain(message))
    data: bytes = msgpack.packb(frame, use_bin_type=True)
    if len(data) > MAX_FRAME_BYTES:
        raise ValueError(f"{name} message is {len(data)} bytes, over the {MAX_FRAME_BYTES} limit")
    return data


# ------------------------------------------------------------------------ decoding


def decode(data: bytes | memoryview) -> Message:
    """Decode one frame, or raise MalformedMessage naming what is wrong with it."""
    return decode_frame(data)[0]


def decode_frame(data: bytes | memoryview) -> tuple[Message, str]:
    """Decode one frame into its message and the session it presents ("" when none).

    A frame of at most :data:`WHOLE_FRAME_BYTES` is unpacked whole and checked against its
    message's decoder. Any other frame, and any such frame that fails, is read against the
    message's declared fields value by value, and every container is refused before its items are
    read when it is not where the message has one or is longer than the message allows: whatever
    the bytes, decoding allocates at most about what the largest legitimate message needs (at most
    :data:`MAX_FRAME_OBJECTS` values), never an amplification.
    """
    size = len(data) if type(data) is bytes else memoryview(data).nbytes
    if size > MAX_FRAME_BYTES:
        raise MalformedMessage(f"frame of {size} bytes is over the {MAX_FRAME_BYTES} limit")
    if size <= WHOLE_FRAME_BYTES:
        if isinstance(data, memoryview) and data.format != "B":
            data = data.cast("B")  # so that data[0] is the first byte
        try:
            return _whole(data)
        except Exception:  # the reader below says what is wrong, naming its path
            pass
    return _by_value(data, size)


def _by_value(data: bytes | memoryview, size: int) -> tuple[Message, str]:
    """A frame read value by value against its message's declared fields."""
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


class _Duplicate(Exception):
    pass


def _unique_map(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _Duplicate
    return out


_WHOLE_OPTIONS: dict[str, Any] = {
    "raw": False,
    "strict_map_key": True,
    "max_str_len": MAX_TEXT_CHARS * 4,
    "max_bin_len": 0,
    "max_ext_len": 0,
    "max_array_len": MAX_PARAMS,
    "max_map_len": MAX_FIELDS + len(_RESERVED) + 1,
}


def _map_size(data: bytes | memoryview) -> int:
    """Entries of the map a frame starts with, read from its header (-1: not a map)."""
    first = data[0]
    if 0x80 <= first <= 0x8F:
        return first & 0x0F
    if first == 0xDE:
        return int.from_bytes(data[1:3], "big")
    if first == 0xDF:
        return int.from_bytes(data[1:5], "big")
    return -1


def _whole(data: bytes | memoryview) -> tuple[Message, str]:
    """A small frame unpacked whole, accepted only when it is exactly a valid message (anything
    else raises, and the value-by-value reader then names what is wrong)."""
    frame = msgpack.unpackb(data, **_WHOLE_OPTIONS)
    first = data[0]
    if len(frame) != (first - 0x80 if 0x80 <= first <= 0x8F else _map_size(data)):
        raise _Duplicate  # a key repeated: unpacked, the last one would silently win
    version = frame["v"]
    name = frame["t"]
    keys = iter(frame)
    lead = next(keys) + next(keys)  # "v" and "t" come first, in either order
    if type(version) is not int or version != PROTOCOL_VERSION or lead not in ("vt", "tv"):
        raise ValueError("not a frame of this version")
    cls = MESSAGE_TYPES[name]
    dec = _DECODERS.get(cls) or decoder(cls)
    if dec.nested:  # maps inside: unpack again, refusing a repeated key in any of them
        frame = msgpack.unpackb(data, object_pairs_hook=_unique_map, **_WHOLE_OPTIONS)
    session = frame.get(SESSION_KEY, "")
    if session:
        if type(session) is not str or len(session) > MAX_SESSION_CHARS:
            raise ValueError("not a session")
        if frame.keys() != dec.frame_keys_session:
            raise ValueError("not the message's fields")
    elif frame.keys() != dec.frame_keys:
        raise ValueError("not the message's fields")
    message = dec.cls(*[convert(frame[n], name, n) for n, convert in dec.converters])
    return message, session


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
    """Reads one frame from the front, one declared value at a time, into the raw maps and lists
    the decoders check."""

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
        dec = decoder(cls)
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
                self.field(dec, fields, name, type_name)
        return dec.build(fields, type_name), session

    def field(self, dec: Decoder, fields: dict[str, Any], name: str, where: str) -> None:
        """Read the raw value of field ``name`` of ``dec``'s record into ``fields``."""
        spec = dec.by_name.get(name)
        if name in fields:
            raise MalformedMessage(f"{where}: field {name!r} appears twice")
        if spec is None:
            # an unknown field is named with the others by Decoder.build; its value is read only
            # when it is a plain value, so no unknown field makes the decoder build a structure
            if self._next_kind() in ("map", "list"):
                raise MalformedMessage(f"{where}: unexpected {name!r}")
            fields[name] = self.scalar(f"{where}.{name}")
            return
        fields[name] = self.value(spec, f"{where}.{name}")

    def value(self, spec: FieldSpec, where: str) -> Any:
        """One raw value of a declared field: containers only where the field has them."""
        if spec.nilable and self._next_is_nil():
            return self.scalar(where)
        if spec.kind is tuple:
            assert spec.item is not None
            kind = self.peek()
            if kind != "list":
                raise MalformedMessage(f"{where}: expected a list, got {_KIND_NAMES[kind]}")
            n = int(self.unpacker.read_array_header())
            most = LIST_LIMITS.get(spec.name, 0)
            if n > most:
                raise MalformedMessage(f"{where}: a list of {n} items, at most {most} allowed")
            return [self.value(spec.item, f"{where}[{i}]") for i in range(n)]
        if issubclass(spec.kind, Record):
            dec = decoder(spec.kind)
            n = self.map_header(where, len(dec.specs) + 1)
            fields: dict[str, Any] = {}
            for _ in range(n):
                self.field(dec, fields, self.key(where), where)
            return fields
        return self.scalar(where)

    def _next_kind(self) -> str:
        at = int(self.unpacker.tell())
        return _kind(self.data[at]) if at < len(self.data) else "end"

    def _next_is_nil(self) -> bool:
        at = int(self.unpacker.tell())
        return at < len(self.data) and self.data[at] == 0xC0


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
