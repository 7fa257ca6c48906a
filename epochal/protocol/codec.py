"""Bytes to messages and back: msgpack, decoded by msgspec straight into the declared records.

A frame is one msgpack map ``{"v": PROTOCOL_VERSION, "t": <type name>, ["m": PROTOCOL_MINOR,]
["s": <session>,] <field>: <value>, ...}``, ``m`` left out when the minor version is 0.
:func:`decode` returns exactly one message of :mod:`epochal.protocol.messages` or raises
:class:`~epochal.errors.MalformedMessage`; nothing else escapes it, whatever the bytes.
:func:`decode_frame` also says what else the frame held (:class:`Decoded`).

Versions: a frame of another major version (``v``) is refused with
:class:`~epochal.errors.ProtocolVersionMismatch`. Within the major version, whatever the minor, a
field a frame leaves out takes its declared default (a required one is missing), and a field this
version does not know is skipped: nothing is built from its value, and its path is returned in
:attr:`Decoded.skipped`.

How a frame is read, each step one call into msgspec's C decoder, so that what a frame costs is
a few nanoseconds a byte whatever its shape (``bench/codec.py`` measures the worst):

1. its map's keys, each value left as a ``msgspec.Raw`` slice of the frame (no object built of
   it): the version, the type, the minor version and the session are read from these, a key
   repeated or a required field left out is refused naming them;
2. the whole frame decoded as its message's class (:data:`~epochal.protocol.registry.wire_type`
   put each field's bounds on its type): a wrong type or a value out of bounds is refused naming
   its path, a list longer than its field allows from its header, and the values of fields this
   version does not know are skipped unread;
3. for a message that holds records (a hello's fingerprint, a report's metrics), the keys of each
   record's map, read as in step 1, to name the fields skipped inside them and refuse a repeated
   key there.
"""

from __future__ import annotations

import itertools
import re
import typing
from typing import Annotated, Any

import msgpack
import msgspec

from epochal.errors import MalformedMessage, ProtocolVersionMismatch
from epochal.protocol.limits import (
    FRAME_KEYS,
    MAX_FIELDS,
    MAX_FRAME_BYTES,
    MAX_KEY_CHARS,
    MAX_SESSION_CHARS,
    MINOR_KEY,
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    SESSION_KEY,
    TYPE_KEY,
    VERSION_KEY,
)
from epochal.protocol.registry import (
    MESSAGE_TYPES,
    TYPE_NAMES,
    Message,
    Record,
    fields_of,
)

# ------------------------------------------------------------------------ encoding


def _plain(value: Any) -> Any:
    """A value msgspec does not encode itself: an instance of a subclass of str, int or float
    (torch's version string, a numpy float) travels as its plain value, as msgpack packs it."""
    for kind in (str, float, int):
        if isinstance(value, kind):
            return kind(value)
    raise TypeError(f"a message cannot carry {type(value).__name__} {value!r}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_plain)


def _map_header(entries: int) -> bytes:
    return bytes([0x80 | entries]) if entries < 16 else b"\xde" + entries.to_bytes(2, "big")


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
    # the record's own map (its fields in order), with the frame's keys spliced in before them
    body = _ENCODER.encode(message)
    fields, at = _map_size(body)
    data = _map_header(fields + len(frame)) + _ENCODER.encode(frame)[1:] + body[at:]
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
    (``decision.go.warmup``), each once, sorted: their values were skipped unread."""


def version_mismatch(theirs: object) -> ProtocolVersionMismatch:
    """The refusal of a frame whose ``v`` is not this process's major version."""
    return ProtocolVersionMismatch(
        f"peer speaks protocol version {theirs!r}, this process speaks "
        f"{PROTOCOL_VERSION}.{PROTOCOL_MINOR} (only peers of one major version interoperate): "
        "install the same epochal version on the coordinator and every worker",
        theirs=theirs,
        ours=PROTOCOL_VERSION,
    )


_Keys = dict[Annotated[str, msgspec.Meta(max_length=MAX_KEY_CHARS)], msgspec.Raw]
_KEYS = msgspec.msgpack.Decoder(Annotated[_Keys, msgspec.Meta(max_length=MAX_FIELDS)])
_FRAME_KEYS = msgspec.msgpack.Decoder(
    Annotated[_Keys, msgspec.Meta(max_length=MAX_FIELDS + len(FRAME_KEYS))]
)
_SCALAR = msgspec.msgpack.Decoder(int | float | str | bool | None)


class _Class:
    """What decoding one record class needs, worked out once."""

    def __init__(self, cls: type) -> None:
        specs = fields_of(cls)
        self.cls = cls
        self.decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(cls)
        self.keys = frozenset(spec.name for spec in specs)
        self.required = tuple(spec.name for spec in specs if spec.required)
        # the fields that hold records: (name, record class, whether a list of them)
        self.records: tuple[tuple[str, type, bool], ...] = tuple(
            (spec.name, kind, spec.item is not None)
            for spec in specs
            for kind in [spec.item.kind if spec.item is not None else spec.kind]
            if isinstance(kind, type) and issubclass(kind, Record)
        )


_CLASSES: dict[type, _Class] = {}


def _class(cls: type) -> _Class:
    found = _CLASSES.get(cls)
    if found is None:
        found = _CLASSES[cls] = _Class(cls)
    return found


def decode(data: bytes | memoryview) -> Message:
    """Decode one frame, or raise MalformedMessage naming what is wrong with it."""
    return decode_frame(data).message


def _size(data: bytes | memoryview) -> int:
    size = len(data) if type(data) is bytes else memoryview(data).nbytes
    if size > MAX_FRAME_BYTES:
        raise MalformedMessage(f"frame of {size} bytes is over the {MAX_FRAME_BYTES} limit")
    return size


def _map_size(data: Any) -> tuple[int, int]:
    """Entries of the map a msgpack value starts with, and where its first key starts: read from
    its header; (-1, 0) when it is not a map."""
    first = data[0]
    if 0x80 <= first <= 0x8F:
        return first & 0x0F, 1
    if first == 0xDE:
        return int.from_bytes(data[1:3], "big"), 3
    if first == 0xDF:
        return int.from_bytes(data[1:5], "big"), 5
    return -1, 0


def _repeated(data: Any, where: str) -> MalformedMessage:
    """The refusal of a map that holds a key twice, naming the key (read again one key at a
    time, each value skipped unread: only once a repeat is known)."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_FRAME_BYTES)
    unpacker.feed(data)
    seen: set[Any] = set()
    for _ in range(unpacker.read_map_header()):
        key = unpacker.unpack()
        if key in seen:
            return MalformedMessage(f"{where}: field {key!r} appears twice")
        seen.add(key)
        unpacker.skip()
    return MalformedMessage(f"{where}: a field appears twice")


def _said(
    exc: msgspec.ValidationError, where: str, data: Any = None, cls: type | None = None
) -> MalformedMessage:
    """msgspec's ``Expected `int`, got `str` - at `$.fingerprint.entries``` as the protocol says
    it: ``hello.fingerprint.entries: expected int, got str``. A record missing a field is told
    with every field it misses, found again in ``data`` (a frame of message ``cls``)."""
    text, _, path = str(exc).partition(" - at `")
    key = path.startswith("key` in `")  # a map's key, not its value
    path = path.removeprefix("key` in `").rstrip("`")[1:]  # "$" is the frame's map
    expected, got = _EXPECTED.match(text), _GOT.search(text)
    if key:
        most = _LENGTH.search(text)
        text = "a field name must be a string" + (
            f" of at most {most[1]} characters" if most else ""
        )
        text += f", got {_TYPES.get(got[1], got[1])}" if got else ""
    elif expected is not None:  # in Python's words: "expected a list, got dict"
        kind = expected[1].removesuffix(" | null")  # a nilable field: None is no news
        text = (
            "expected " + _KINDS.get(kind, kind) + _LENGTH.sub(r" of at most \1 items", expected[2])
        )
        if got is not None:
            text += ", got " + _TYPES.get(got[1], got[1])
    elif text.startswith("Object missing required field ") and cls is not None:
        try:
            text = "missing " + ", ".join(_missing(data, cls, path))
        except Exception:  # the record's keys are not all names: say the one msgspec said
            pass
    return MalformedMessage(f"{where}{path}: {text.replace('`', '')}")


_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


def _missing(data: Any, cls: type, path: str) -> list[str]:
    """Every required field the record at ``path`` (``.fingerprint``, ``.params[0]``) of a frame
    of ``cls`` leaves out, read again from its keys (only once one is known to be missing)."""
    raw: Any = data
    for name, index in _STEP.findall(path):
        if name:
            raw = _KEYS.decode(raw)[name] if raw is not data else _FRAME_KEYS.decode(raw)[name]
            spec = next(s for s in fields_of(cls) if s.name == name)
            cls = spec.item.kind if spec.item is not None else spec.kind
        else:
            raw = _RAW_ITEMS.decode(raw)[int(index)]
    keys = _KEYS.decode(raw) if raw is not data else _FRAME_KEYS.decode(raw)
    return [field for field in _class(cls).required if field not in keys]


_EXPECTED = re.compile(r"Expected `([^`]*)`((?: of length [<>]= \d+)?)")
_LENGTH = re.compile(r" of length <= (\d+)")
_GOT = re.compile(r", got `([^`]*)`")
_KINDS = {"array": "a list", "object": "a map"}
_TYPES = {"array": "list", "object": "dict", "None": "NoneType", "binary": "bytes"}


def _unreadable(exc: Exception) -> MalformedMessage:
    if isinstance(exc, RecursionError):
        return MalformedMessage("not a msgpack frame: its values nest too deep")
    return MalformedMessage(f"not a msgpack frame: {type(exc).__name__}: {exc}")


def _frame_keys(data: bytes | memoryview) -> _Keys:
    """The frame's keys, each value a Raw slice; the version checked first, then the type."""
    try:
        keys = _FRAME_KEYS.decode(data)
    except msgspec.ValidationError as exc:
        raise _said(exc, "frame") from None
    except Exception as exc:  # msgspec.DecodeError for bad bytes, RecursionError for deep ones
        raise _unreadable(exc) from None
    # "v" and "t" lead a frame of this version, in either order: a frame laid out otherwise is
    # another version's, and a key after a key that is not one of them is not read as them
    lead = list(itertools.takewhile(_LEAD_KEYS.__contains__, itertools.islice(keys, 2)))
    raw = keys[VERSION_KEY] if VERSION_KEY in lead else None
    version = _scalar(raw) if raw is not None else None
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise version_mismatch(version)
    if TYPE_KEY not in lead:
        raise MalformedMessage("unknown message type None")
    if len(keys) != _map_size(data)[0]:
        raise _repeated(data, "frame")
    return keys


def _scalar(raw: msgspec.Raw) -> Any:
    """A frame key's value if it is a plain one; a container is none of the values it may be."""
    try:
        return _SCALAR.decode(raw)
    except msgspec.ValidationError:
        return _Container()
    except Exception as exc:
        raise _unreadable(exc) from None


class _Container:
    def __repr__(self) -> str:
        return "a container"


def message_type(data: bytes | memoryview) -> str:
    """The wire name of the message a frame says it holds, read from its first bytes alone (its
    version and type, nothing else) when it is laid out as :func:`encode` lays it, else from its
    keys; or ProtocolVersionMismatch / MalformedMessage.

    What a peer outside the run may send is a ``hello``: the coordinator reads the type of its
    other frames this way, to answer them without decoding them.
    """
    size = _size(data)
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
    return _type_name(_frame_keys(data))


_LEAD = b"\xa1v" + bytes([PROTOCOL_VERSION])


def _type_name(keys: _Keys) -> str:
    raw = keys.get(TYPE_KEY)
    name = _scalar(raw) if raw is not None else None
    if type(name) is not str or name not in MESSAGE_TYPES:
        raise MalformedMessage(f"unknown message type {name!r}")
    return name


_LEAD_KEYS = frozenset((VERSION_KEY, TYPE_KEY))


class _Lead(msgspec.Struct):
    """A frame's session and minor version, read past every other key unbuilt."""

    s: Any = ""
    m: Any = 0


_LEAD_DECODER = msgspec.msgpack.Decoder(_Lead)


def _as_encoded(data: bytes | memoryview) -> Decoded | None:
    """The frame decoded, if it is exactly what :func:`encode` writes for a message of this
    version and minor version (a worker's every frame but its hello, the coordinator's every
    frame); None for any other frame, which the full reading then reads or refuses. What this
    skips, reading every key of the frame first, cost as much as building the message."""
    if isinstance(data, memoryview) and data.format != "B":
        data = data.cast("B")
    if not (
        len(data) > 7
        and 0x80 <= data[0] <= 0x8F
        and data[1:4] == _LEAD
        and data[4:6] == b"\xa1t"
        and 0xA0 <= data[6] <= 0xBF
    ):
        return None
    cls = MESSAGE_TYPES.get(bytes(data[7 : 7 + data[6] - 0xA0]).decode("utf-8", "replace"))
    if cls is None:
        return None
    try:
        lead = _LEAD_DECODER.decode(data)
        message = _class(cls).decoder.decode(data)
    except Exception:  # read again in full, which names what is wrong
        return None
    session = lead.s
    if type(session) is not str or type(lead.m) is not int:
        return None
    if not _canonical(data, message, session, lead.m):
        return None
    return tuple.__new__(Decoded, (message, session, lead.m, ()))


def decode_frame(data: bytes | memoryview) -> Decoded:
    """Decode one frame into its message, the session it presents, its minor version and the
    fields it skipped; see the module docstring for how. A frame over :data:`MAX_FRAME_BYTES` is
    refused unread."""
    _size(data)
    if (decoded := _as_encoded(data)) is not None:
        return decoded
    keys = _frame_keys(data)
    name = _type_name(keys)
    known = _class(MESSAGE_TYPES[name])
    session, minor = "", 0
    if SESSION_KEY in keys:
        session = _scalar(keys[SESSION_KEY])
        if type(session) is not str or not 0 < len(session) <= MAX_SESSION_CHARS:
            raise MalformedMessage(
                f"{name}: the session must be a string of 1-{MAX_SESSION_CHARS} characters"
            )
    if MINOR_KEY in keys:
        minor = _scalar(keys[MINOR_KEY])
        if type(minor) is not int or minor < 0:
            raise MalformedMessage(f"{name}: the minor version must be an int >= 0, got {minor!r}")
    unknown = [k for k in keys if k not in known.keys and k not in FRAME_KEYS]
    missing = [field for field in known.required if field not in keys]
    if missing:
        beside = f" (it has {', '.join(map(repr, unknown))}, not fields of this version)"
        raise MalformedMessage(f"{name}: missing {', '.join(missing)}{beside if unknown else ''}")
    try:
        message = known.decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise _said(exc, name, data, known.cls) from None
    except Exception as exc:
        raise _unreadable(exc) from None
    if not unknown and known.records and _canonical(data, message, session, minor):
        # the bytes this version writes for the message: no record holds a key twice or one
        # this version does not know, and reading their keys again would find nothing
        return tuple.__new__(Decoded, (message, session, minor, ()))
    skipped = [f"{name}.{k}" for k in unknown]
    for field, cls, many in known.records:
        if field in keys:
            _record_keys(keys[field], cls, many, f"{name}.{field}", skipped)
    if not skipped:  # every frame of this version: made without the named tuple's __new__
        return tuple.__new__(Decoded, (message, session, minor, ()))
    return Decoded(message, session, minor, tuple(sorted(set(skipped))))


def _canonical(data: bytes | memoryview, message: Message, session: str, minor: int) -> bool:
    """Whether ``data`` is exactly what :func:`encode` writes for ``message`` (a frame of this
    version, from a peer of this minor version: a worker's every frame). Encoding costs less
    than reading the keys of each record inside the frame again."""
    if minor != PROTOCOL_MINOR or len(session) > MAX_SESSION_CHARS:
        return False
    try:
        return encode(message, session) == data
    except (TypeError, ValueError):  # not one this version would write
        return False


def _record_keys(raw: msgspec.Raw, cls: type, many: bool, where: str, skipped: list[str]) -> None:
    """Step 3: the keys of a record's map (or of each map of a list of them, ``many``) that was
    decoded already: a repeated one refused, an unknown one added to ``skipped`` by its path."""
    view = memoryview(raw)
    if view.nbytes == 1 and view[0] == 0xC0:  # a nilable record left out: nil
        return
    known = _class(cls)
    for item in _RAW_ITEMS.decode(raw) if many else [raw]:
        try:
            keys = _KEYS.decode(item)
        except msgspec.ValidationError as exc:  # too wide, or a name too long
            raise _said(exc, where) from None
        except Exception as exc:  # a name that is not UTF-8 (msgspec skipped it unread)
            raise _unreadable(exc) from None
        if len(keys) != _map_size(memoryview(item))[0]:
            raise _repeated(memoryview(item), where)
        skipped.extend(f"{where}.{k}" for k in keys if k not in known.keys)
        for field, inner, inner_many in known.records:
            if field in keys:
                _record_keys(keys[field], inner, inner_many, f"{where}.{field}", skipped)


_RAW_ITEMS = msgspec.msgpack.Decoder(list[msgspec.Raw])
