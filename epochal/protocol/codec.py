"""Bytes to messages and back: msgpack with bounded, field-by-field validated decoding.

A frame is one msgpack map ``{"v": PROTOCOL_VERSION, "t": <type name>, ["m": PROTOCOL_MINOR,]
["s": <session>,] <field>: <value>, ...}``, ``m`` left out when the minor version is 0.
:func:`decode` returns exactly one message of :mod:`epochal.protocol.messages` or raises
:class:`~epochal.errors.MalformedMessage`; nothing else escapes it, whatever the bytes.
:func:`decode_frame` also says what else the frame held (:class:`Decoded`).

Versions: a frame of another major version (``v``) is refused with
:class:`~epochal.errors.ProtocolVersionMismatch`. Within the major version, whatever the minor, a
field a frame leaves out takes its declared default (a required one is missing), and a field this
version does not know is skipped: its value is held to the same bounds (a huge one is refused,
not skipped), nothing is built from it, and its path is returned in :attr:`Decoded.skipped`.

Each record class gets one decoder, compiled once from its declared fields
(:func:`~epochal.protocol.registry.fields_of`): a converter per field that checks the raw value's
type and builds the field's value. A frame (at most
:data:`~epochal.protocol.limits.MAX_FRAME_BYTES`) is unpacked whole and run through them; a
frame that fails there is read value by value against the same declared fields (never decoding a
container the message does not have, nor a list longer than its field allows) and run through the
same converters, which name the path of what is wrong.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Callable
from typing import Any

import msgpack

from epochal.errors import MalformedMessage, ProtocolVersionMismatch
from epochal.protocol.decoders import DECODERS, decoder
from epochal.protocol.limits import (
    FRAME_KEYS,
    MAX_FIELDS,
    MAX_FRAME_BYTES,
    MAX_LIST_ITEMS,
    MAX_SESSION_CHARS,
    MAX_TEXT_CHARS,
    MINOR_KEY,
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    SESSION_KEY,
    TYPE_KEY,
    VERSION_KEY,
    WHOLE_FRAME_BYTES,
)
from epochal.protocol.reader import Reader
from epochal.protocol.registry import (
    MESSAGE_TYPES,
    TYPE_NAMES,
    FieldSpec,
    Message,
    Record,
    fields_of,
)

# ------------------------------------------------------------------------ encoding


def _encoder(spec: FieldSpec) -> Callable[[Any], Any] | None:
    """How a field's value becomes plain msgpack data; None: as it is (a StrEnum packs as its
    string, byte for byte)."""
    if spec.kind is tuple:
        assert spec.item is not None
        item = _encoder(spec.item)
        if item is None:  # a list of plain values (an optional one may be None)
            return lambda value: None if value is None else list(value)
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
    frame: dict[str, Any] = {VERSION_KEY: PROTOCOL_VERSION, TYPE_KEY: name}
    if PROTOCOL_MINOR:
        frame[MINOR_KEY] = PROTOCOL_MINOR
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


class Decoded(typing.NamedTuple):
    """One frame decoded: its message and what else the frame held."""

    message: Message
    session: str = ""
    """The session a worker's frame presents; "" when none."""
    minor: int = 0
    """The minor version of the peer that wrote it (``m``; 0 when left out)."""
    skipped: tuple[str, ...] = ()
    """The fields it carried that this version does not know, by path without list indexes
    (``decision.go.warmup``), each once, sorted: their values were checked and dropped."""


def decode(data: bytes | memoryview) -> Message:
    """Decode one frame, or raise MalformedMessage naming what is wrong with it."""
    return decode_frame(data).message


def decode_frame(data: bytes | memoryview) -> Decoded:
    """Decode one frame into its message, the session it presents, its minor version and the
    fields it skipped.

    A frame over :data:`MAX_FRAME_BYTES` is refused unread. A frame of at most
    :data:`WHOLE_FRAME_BYTES` (all the others) is unpacked whole and checked against its message's
    decoder. One that fails is read against the message's declared fields value by value, and
    every container is refused before its items are read when it is not where the message has one
    (or, in a field it does not know, when it is longer or deeper than any frame may hold) or is
    longer than the message allows: whatever the bytes, decoding allocates at most a few MiB (see
    :mod:`epochal.protocol.limits`), never an amplification.
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


_INDEX = re.compile(r"\[\d+\]")


def _decoded(message: Message, session: str, minor: int, skipped: list[str]) -> Decoded:
    if not skipped:  # every frame of this version: made without the named tuple's __new__
        return tuple.__new__(Decoded, (message, session, minor, ()))
    return Decoded(message, session, minor, tuple(sorted({_INDEX.sub("", p) for p in skipped})))


_LEAD = b"\xa1v" + bytes([PROTOCOL_VERSION])


def message_type(data: bytes | memoryview) -> str:
    """The wire name of the message a frame says it holds, read from its first bytes alone (its
    version and type, nothing else), or ProtocolVersionMismatch / MalformedMessage.

    What a peer outside the run may send is a ``hello``: the coordinator reads the type of its
    other frames this way, to answer them without decoding them.
    """
    size = len(data) if type(data) is bytes else memoryview(data).nbytes
    if size > MAX_FRAME_BYTES:
        raise MalformedMessage(f"frame of {size} bytes is over the {MAX_FRAME_BYTES} limit")
    if isinstance(data, memoryview) and data.format != "B":
        data = data.cast("B")
    # the encoder's layout, {"v": <this version>, "t": <fixstr>, ...} in a fixmap: read in place
    if (
        size > 7
        and 0x80 <= data[0] <= 0x8F
        and data[1:4] == _LEAD
        and data[4:6] == b"\xa1t"
        and 0xA0 <= data[6] <= 0xBF
    ):
        name = bytes(data[7 : 7 + data[6] - 0xA0]).decode("utf-8", errors="replace")
        if name in MESSAGE_TYPES:
            return name
    try:
        return Reader(data).head()[2]
    except (MalformedMessage, ProtocolVersionMismatch):
        raise
    except Exception as exc:  # msgpack raises a zoo of types on bad input; all mean the same
        raise MalformedMessage(f"not a msgpack frame: {type(exc).__name__}: {exc}") from None


def _by_value(data: bytes | memoryview, size: int) -> Decoded:
    """A frame read value by value against its message's declared fields."""
    reader = Reader(data)
    try:
        message, session, minor, skipped = reader.frame()
        if reader.unpacker.tell() != size:
            raise MalformedMessage("not a msgpack frame: extra bytes after the frame's map")
    except (MalformedMessage, ProtocolVersionMismatch):
        raise
    except Exception as exc:  # msgpack raises a zoo of types on bad input; all mean the same
        raise MalformedMessage(f"not a msgpack frame: {type(exc).__name__}: {exc}") from None
    return _decoded(message, session, minor, skipped)


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
    "max_array_len": MAX_LIST_ITEMS,
    "max_map_len": MAX_FIELDS + len(FRAME_KEYS),
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


def _whole(data: bytes | memoryview) -> Decoded:
    """A small frame unpacked whole, accepted only when it is exactly a valid message (anything
    else raises, and the value-by-value reader then names what is wrong)."""
    frame = msgpack.unpackb(data, **_WHOLE_OPTIONS)
    first = data[0]
    if len(frame) != (first - 0x80 if 0x80 <= first <= 0x8F else _map_size(data)):
        raise _Duplicate  # a key repeated: unpacked, the last one would silently win
    version = frame[VERSION_KEY]
    name = frame[TYPE_KEY]
    keys = iter(frame)
    lead = next(keys) + next(keys)  # "v" and "t" come first, in either order
    if type(version) is not int or version != PROTOCOL_VERSION or lead not in ("vt", "tv"):
        raise ValueError("not a frame of this version")
    cls = MESSAGE_TYPES[name]
    dec = DECODERS.get(cls) or decoder(cls)
    skipped: list[str] = []
    session, minor = "", 0
    if frame.keys() == dec.frame_keys:  # a frame of this version without a session
        message = dec.cls(*[convert(frame[n], name, n, skipped) for n, convert in dec.converters])
    else:
        if SESSION_KEY in frame:
            session = frame[SESSION_KEY]
            if type(session) is not str or not 0 < len(session) <= MAX_SESSION_CHARS:
                raise ValueError("not a session")
        if MINOR_KEY in frame:
            minor = frame[MINOR_KEY]
            if type(minor) is not int or minor < 0:
                raise ValueError("not a minor version")
        if frame.keys() == dec.frame_keys_session:
            values = [convert(frame[n], name, n, skipped) for n, convert in dec.converters]
            message = dec.cls(*values)
        else:  # another minor version's: fields left out or not known here
            fields = {k: v for k, v in frame.items() if k not in FRAME_KEYS}
            message = dec.build(fields, name, skipped)
    if dec.nested or skipped:
        # maps inside: unpack again, refusing a repeated key in any of them (only once the frame
        # proved valid, so that junk never costs a Python call per map)
        msgpack.unpackb(data, object_pairs_hook=_unique_map, **_WHOLE_OPTIONS)
    return _decoded(message, session, minor, skipped)
