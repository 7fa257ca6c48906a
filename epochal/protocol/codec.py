"""Bytes to messages and back: msgpack with bounded, field-by-field validated decoding.

A frame is one msgpack map ``{"v": PROTOCOL_VERSION, "t": <type name>, <field>: <value>, ...}``.
:func:`decode` returns exactly one message of :mod:`epochal.protocol.messages` or raises
:class:`~epochal.errors.MalformedMessage`; nothing else escapes it, whatever the bytes.

Each record class gets one decoder, compiled once from its declared fields
(:func:`~epochal.protocol.records.fields_of`): a converter per field that checks the raw value's
type and builds the field's value. A frame (at most
:data:`~epochal.protocol.messages.MAX_FRAME_BYTES`) is unpacked whole and run through them; a
frame that fails there is read value by value against the same declared fields (never decoding a
container the message does not have, nor a list longer than its field allows) and run through the
same converters, which name the path of what is wrong.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

import msgpack

from epochal.errors import MalformedMessage, ProtocolVersionMismatch
from epochal.protocol.decoders import DECODERS, RESERVED, decoder
from epochal.protocol.limits import (
    MAX_FIELDS,
    MAX_LIST_ITEMS,
    SESSION_KEY,
    WHOLE_FRAME_BYTES,
)
from epochal.protocol.messages import (
    MAX_FRAME_BYTES,
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
from epochal.protocol.reader import Reader

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

    A frame over :data:`MAX_FRAME_BYTES` is refused unread. A frame of at most
    :data:`WHOLE_FRAME_BYTES` (all the others) is unpacked whole and checked against its message's
    decoder. One that fails is read against the message's declared fields value by value, and
    every container is refused before its items are read when it is not where the message has one
    or is longer than the message allows: whatever the bytes, decoding allocates at most a few MiB
    (see :mod:`epochal.protocol.limits`), never an amplification.
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


def _by_value(data: bytes | memoryview, size: int) -> tuple[Message, str]:
    """A frame read value by value against its message's declared fields."""
    reader = Reader(data)
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
    "max_array_len": MAX_LIST_ITEMS,
    "max_map_len": MAX_FIELDS + len(RESERVED) + 1,
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
    dec = DECODERS.get(cls) or decoder(cls)
    session = frame.get(SESSION_KEY, "")
    if session:
        if type(session) is not str or len(session) > MAX_SESSION_CHARS:
            raise ValueError("not a session")
        if frame.keys() != dec.frame_keys_session:
            raise ValueError("not the message's fields")
    elif frame.keys() != dec.frame_keys:
        raise ValueError("not the message's fields")
    message = dec.cls(*[convert(frame[n], name, n) for n, convert in dec.converters])
    if dec.nested:
        # maps inside: unpack again, refusing a repeated key in any of them (only once the frame
        # proved valid, so that junk never costs a Python call per map)
        msgpack.unpackb(data, object_pairs_hook=_unique_map, **_WHOLE_OPTIONS)
    return message, session
