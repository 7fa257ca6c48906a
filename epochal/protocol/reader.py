"""The value-by-value frame reader: reads one frame from the front, one declared value at a time.

Used for a frame that failed the whole-frame path, to name the path of what is wrong. It never
decodes a container the message does not have, nor a list longer than its field allows, so an
adversarial frame costs no more memory than a valid one of its message. A field it does not know
(a newer minor version's) it reads past value by value, holding none of it, within the bounds of
:mod:`epochal.protocol.limits`: a list of at most MAX_LIST_ITEMS, a map of at most MAX_FIELDS,
at most MAX_DEPTH deep, at most MAX_SKIPPED_VALUES values in all the unknown fields of one map,
every value counted.
"""

from __future__ import annotations

import typing
from typing import Any

import msgpack

from epochal.errors import MalformedMessage, ProtocolVersionMismatch
from epochal.protocol.decoders import SKIPPED, Budget, Decoder, decoder
from epochal.protocol.limits import (
    FRAME_KEYS,
    MAX_DEPTH,
    MAX_FIELDS,
    MAX_FRAME_OBJECTS,
    MAX_KEY_CHARS,
    MAX_LIST_ITEMS,
    MAX_SESSION_CHARS,
    MAX_TEXT_CHARS,
    MINOR_KEY,
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    SESSION_KEY,
    TYPE_KEY,
    VERSION_KEY,
)
from epochal.protocol.registry import MESSAGE_TYPES, FieldSpec, Message, Record

LEAD = (VERSION_KEY, TYPE_KEY)
"""The keys a frame starts with, in either order."""


def version_mismatch(theirs: object) -> ProtocolVersionMismatch:
    """The refusal of a frame whose ``v`` is not this process's major version."""
    return ProtocolVersionMismatch(
        f"peer speaks protocol version {theirs!r}, this process speaks "
        f"{PROTOCOL_VERSION}.{PROTOCOL_MINOR} (only peers of one major version interoperate): "
        "install the same epochal version on the coordinator and every worker",
        theirs=theirs,
        ours=PROTOCOL_VERSION,
    )


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
"""Bytes the reader copies out of a frame at a time, not the whole frame at once."""


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


class Reader:
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

    def head(self) -> tuple[int, int, str, str | None]:
        """The frame's map header and its leading ``v`` and ``t``, nothing more: the map's size,
        how many entries were read, the message type's name, and the field name read past them
        (None: none was). Raises ProtocolVersionMismatch or MalformedMessage."""
        kind = self.peek()
        if kind != "map":
            raise MalformedMessage(f"frame is a {_KIND_NAMES[kind]}, expected a map")
        n = int(self.unpacker.read_map_header())
        if n > MAX_FIELDS + len(FRAME_KEYS):
            raise MalformedMessage(f"frame is a map of {n} entries, more than a frame may hold")
        head: dict[str, Any] = {}
        for _ in range(min(n, 2)):  # "v" and "t" come first, so the rest is read by its schema
            name = self.key("frame")
            if name not in LEAD or name in head:
                break
            if name == TYPE_KEY and self.peek() in ("map", "list"):
                raise MalformedMessage("unknown message type: a container, not a name")
            head[name] = self.scalar(f"frame.{name}")
        else:
            name = None
        version = head.get(VERSION_KEY)
        if type(version) is not int or version != PROTOCOL_VERSION:
            raise version_mismatch(version)
        type_name = head.get(TYPE_KEY)
        if not isinstance(type_name, str) or type_name not in MESSAGE_TYPES:
            raise MalformedMessage(f"unknown message type {type_name!r}")
        return n, len(head), type_name, name

    def frame(self) -> tuple[Message, str, int, list[str]]:
        """The frame's message, its session ("" when none), its minor version and the paths of
        the fields it carried that this version does not know (skipped)."""
        n, read, type_name, name = self.head()
        dec = decoder(MESSAGE_TYPES[type_name])
        session: str | None = None
        minor: int | None = None
        fields: dict[str, Any] = {}
        budget = Budget()
        for i in range(n - read):
            if i > 0 or name is None:
                name = self.key(type_name)
            if name in LEAD or (name == SESSION_KEY and session is not None):
                raise MalformedMessage(f"{type_name}: field {name!r} appears twice")
            if name == MINOR_KEY and minor is not None:
                raise MalformedMessage(f"{type_name}: field {name!r} appears twice")
            if name == SESSION_KEY:
                value = self.scalar(f"{type_name}.{name}")
                if not isinstance(value, str) or not 0 < len(value) <= MAX_SESSION_CHARS:
                    raise MalformedMessage(
                        f"{type_name}: the session must be a string of 1-{MAX_SESSION_CHARS} "
                        "characters"
                    )
                session = value
            elif name == MINOR_KEY:
                value = self.scalar(f"{type_name}.{name}")
                if type(value) is not int or value < 0:
                    raise MalformedMessage(
                        f"{type_name}: the minor version must be an int >= 0, got {value!r}"
                    )
                minor = value
            else:
                self.field(dec, fields, name, type_name, budget)
        skipped: list[str] = []
        message = dec.build(fields, type_name, skipped)
        return message, session or "", minor or 0, skipped

    def field(
        self, dec: Decoder, fields: dict[str, Any], name: str, where: str, budget: Budget
    ) -> None:
        """Read the raw value of field ``name`` of ``dec``'s record into ``fields``; a field the
        record does not have is read past (:meth:`skip`, spending its map's ``budget``) and kept
        as SKIPPED."""
        if name in fields:
            raise MalformedMessage(f"{where}: field {name!r} appears twice")
        spec = dec.by_name.get(name)
        if spec is None:
            self.skip(f"{where}.{name}", 0, budget)
            fields[name] = SKIPPED
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
            if n > spec.max_items:
                raise MalformedMessage(
                    f"{where}: a list of {n} items, at most {spec.max_items} allowed"
                )
            return [self.value(spec.item, f"{where}[{i}]") for i in range(n)]
        if issubclass(spec.kind, Record):
            dec = decoder(spec.kind)
            n = self.map_header(where, MAX_FIELDS)
            fields: dict[str, Any] = {}
            budget = Budget()
            for _ in range(n):
                self.field(dec, fields, self.key(where), where, budget)
            return fields
        return self.scalar(where)

    def skip(self, where: str, depth: int, budget: Budget) -> None:
        """Read past one value of a field this version does not know, building nothing of it:
        plain values, and lists and maps of them within the frame's bounds, at most
        MAX_SKIPPED_VALUES values in all the unknown fields of a map together."""
        budget.spend(where)
        kind = self._next_kind()
        if kind not in ("list", "map"):
            self.scalar(where)
            return
        if depth >= MAX_DEPTH:
            raise MalformedMessage(
                f"{where}: an unknown field's value nested deeper than {MAX_DEPTH} containers"
            )
        if kind == "list":
            self.peek()
            n = int(self.unpacker.read_array_header())
            if n > MAX_LIST_ITEMS:
                raise MalformedMessage(
                    f"{where}: a list of {n} items, at most {MAX_LIST_ITEMS} allowed"
                )
            for i in range(n):
                self.skip(f"{where}[{i}]", depth + 1, budget)
            return
        n = self.map_header(where, MAX_FIELDS)
        seen: set[str] = set()
        for _ in range(n):
            name = self.key(where)
            if name in seen:
                raise MalformedMessage(f"{where}: field {name!r} appears twice")
            seen.add(name)
            self.skip(f"{where}.{name}", depth + 1, budget)

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
