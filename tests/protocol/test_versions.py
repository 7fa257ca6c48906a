"""Peers one minor version apart interoperate; another major version is refused.

A frame's ``v`` is the major version and ``m`` the minor (left out when 0). Within the major
version a peer skips the fields it does not know, their values still held to the frame's bounds
(a huge one is refused, not skipped), and a field a frame leaves out takes its declared default.
The rule that keeps this true, a new field has a default and a new message type or a field
without one is a major bump, is held here against the registry (:data:`REQUIRED`).
"""

from __future__ import annotations

import dataclasses
import tracemalloc
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epochal.errors import MalformedMessage, ProtocolVersionMismatch
from epochal.protocol import codec, encode
from epochal.protocol.codec import Decoded, decode_frame, message_type
from epochal.protocol.messages import (
    MAX_FIELDS,
    MAX_FRAME_BYTES,
    MAX_KEY_CHARS,
    MAX_LIST_ITEMS,
    MAX_TEXT_CHARS,
    MESSAGE_TYPES,
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    TYPE_NAMES,
    Heartbeat,
    Record,
    fields_of,
)
from epochal.protocol.skipped import MAX_TOLD, SkippedFields
from tests.protocol.examples import examples
from tests.protocol.test_codec import messages, msgpack_objects, pack

NEWER = PROTOCOL_MINOR + 1
LATER = {"note": "from a later minor", "sizes": [1, 2.5, None, True], "more": {"x": [1]}}
"""An unknown field's value as a newer peer might send it: plain values, a list and a map."""


def frame_of(message: Any, session: str = "") -> dict[str, Any]:
    frame = msgpack.unpackb(encode(message, session=session), raw=False)
    assert isinstance(frame, dict)
    return frame


def _add_later(raw: dict[str, Any], cls: type, path: str, added: set[str]) -> None:
    """Give the map of record ``cls`` at ``path``, and every record map inside it, a field
    ``later``; collect the paths (without list indexes) as the decoder names them."""
    for spec in fields_of(cls):
        kind = spec.item.kind if spec.item is not None else spec.kind
        value = raw.get(spec.name)
        if not (isinstance(kind, type) and issubclass(kind, Record)) or value is None:
            continue
        for item in value if spec.item is not None else [value]:
            _add_later(item, kind, f"{path}.{spec.name}", added)
    raw["later"] = LATER
    added.add(f"{path}.later")


def newer(message: Any, session: str = "") -> tuple[bytes, tuple[str, ...]]:
    """``message`` as a peer one minor version newer sends it, with a field this version does not
    know in the frame and in every nested record; and the paths the decoder must say it skipped."""
    frame = frame_of(message, session) | {"m": NEWER}
    added: set[str] = set()
    _add_later(frame, type(message), TYPE_NAMES[type(message)], added)
    return pack(frame), tuple(sorted(added))


@pytest.mark.parametrize("cls", list(MESSAGE_TYPES.values()), ids=TYPE_NAMES.get)
def test_a_newer_minors_frame_with_fields_this_version_does_not_know_decodes(cls: type):
    for message in examples(cls):
        data, added = newer(message, session="abc")
        expected = Decoded(message, "abc", NEWER, added)
        assert decode_frame(data) == expected
        assert message_type(data) == TYPE_NAMES[cls]


DEFAULTED = [
    (cls, spec.name)
    for cls in MESSAGE_TYPES.values()
    for spec in fields_of(cls)
    if not spec.required
]


@pytest.mark.parametrize(
    ("cls", "field"), DEFAULTED, ids=[f"{TYPE_NAMES[c]}.{f}" for c, f in DEFAULTED]
)
def test_an_older_minors_frame_without_a_defaulted_field_takes_its_default(cls: type, field: str):
    default = next(spec.default for spec in fields_of(cls) if spec.name == field)
    taken = 0
    for message in examples(cls):
        try:  # examples where the default agrees with the other fields (a go needs stop False)
            older = dataclasses.replace(message, **{field: default})
        except ValueError:
            continue
        frame = frame_of(message, session="abc")
        del frame[field]
        data = pack(frame)
        assert decode_frame(data) == Decoded(older, "abc", PROTOCOL_MINOR)
        taken += 1
    assert taken, f"no example of {cls.__name__} can leave out {field}"


def test_a_required_field_left_out_is_missing_whatever_the_minor():
    frame = frame_of(examples(MESSAGE_TYPES["store_ready"])[0]) | {"m": NEWER}
    del frame["port"]
    with pytest.raises(MalformedMessage, match="store_ready: missing port"):
        decode_frame(pack(frame))


@pytest.mark.parametrize("major", [PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1])
@pytest.mark.parametrize("minor", [0, NEWER])
def test_another_major_version_is_refused_naming_both_versions(major: int, minor: int):
    frame = frame_of(Heartbeat()) | {"v": major}
    if minor:
        frame["m"] = minor
    for read in (decode_frame, message_type):
        with pytest.raises(ProtocolVersionMismatch) as info:
            read(pack(frame))
        assert (info.value.theirs, info.value.ours) == (major, PROTOCOL_VERSION)
        said = str(info.value)
        assert f"peer speaks protocol version {major}," in said
        assert f"this process speaks {PROTOCOL_VERSION}.{PROTOCOL_MINOR}" in said
        assert "install the same epochal version" in said


def test_this_version_writes_its_minor_after_the_lead_only_when_it_is_not_zero(
    monkeypatch: pytest.MonkeyPatch,
):
    frame = frame_of(Heartbeat(), session="abc")
    assert ("m" in frame) == (PROTOCOL_MINOR != 0) and frame.get("m", 0) == PROTOCOL_MINOR
    monkeypatch.setattr(codec, "PROTOCOL_MINOR", 7)
    data = encode(Heartbeat(), session="abc")
    assert list(msgpack.unpackb(data)) == ["v", "t", "m", "s"]
    assert decode_frame(data) == Decoded(Heartbeat(), "abc", 7)
    assert message_type(data) == "heartbeat"


@pytest.mark.parametrize("minor", [-1, "1", True, 1.5, None, [1]])
def test_the_minor_version_is_a_whole_number(minor: Any):
    frame = frame_of(Heartbeat()) | {"m": minor}
    with pytest.raises(MalformedMessage, match=r"minor version must be an int >= 0"):
        decode_frame(pack(frame))


def _raw_frame(*pairs: tuple[str, Any]) -> bytes:
    """A frame with exactly these keys, in this order, repeated keys included."""
    data = bytes([0x80 + len(pairs)])
    for key, value in pairs:
        data += pack(key) + pack(value)
    return data


@pytest.mark.parametrize("key", ["m", "s", "v", "t", "later"])
def test_a_frame_key_appears_once(key: str):
    value = {"m": 1, "s": "abc", "v": PROTOCOL_VERSION, "t": "heartbeat", "later": 1}[key]
    data = _raw_frame(("v", PROTOCOL_VERSION), ("t", "heartbeat"), (key, value), (key, value))
    with pytest.raises(MalformedMessage, match=f"field '{key}' appears twice"):
        decode_frame(data)


SKIPPED = [
    ("a wide map", {f"k{i}": 0 for i in range(MAX_FIELDS + 1)}),
    ("a deep nesting", [[[[[[{"k": [[]]}]]]]]]),
    ("a long key", {"k" * (MAX_KEY_CHARS + 1): 0}),
    ("a long string", "x" * (MAX_TEXT_CHARS * 4 + 1)),
    ("many values", [0] * 10_000),
    ("a long list", [None] * (MAX_LIST_ITEMS + 1)),
    ("a repeated key", "repeated"),
    ("bytes", b"\x00" * 1000),
    ("an extension", msgpack.ExtType(1, b"x")),
    ("the longest string", "\U0001f600" * MAX_TEXT_CHARS),
]
"""Values a field this version does not know may hold: any msgpack value, since it is skipped
unread (nothing is built of it, see :func:`test_a_frame_full_of_unknown_values_is_skipped_building_
nothing`); only the frame's size bounds it."""


def _with_later(value: Any, where: str) -> bytes:
    goes_on = next(d for d in examples(MESSAGE_TYPES["decision"]) if d.go is not None)
    frame = frame_of(goes_on) | {"m": NEWER}
    target = frame if where == "frame" else frame["go"]
    target["later"] = {"a": 1} if value == "repeated" else value
    data = pack(frame)
    if value == "repeated":  # a map holding "a" twice
        data = data.replace(b"\x81\xa1a\x01", b"\x82\xa1a\x01\xa1a\x02")
    return data


@pytest.mark.parametrize("value", [v[1] for v in SKIPPED], ids=[v[0] for v in SKIPPED])
def test_an_unknown_fields_value_of_any_shape_is_skipped(value: Any):
    goes_on = next(d for d in examples(MESSAGE_TYPES["decision"]) if d.go is not None)
    for where, path in (("frame", "decision.later"), ("nested", "decision.go.later")):
        data = _with_later(value, where)
        assert len(data) <= MAX_FRAME_BYTES
        assert decode_frame(data) == Decoded(goes_on, minor=NEWER, skipped=(path,))


def test_the_keys_of_a_frame_and_of_its_records_are_bounded():
    # the maps the decoder reads the keys of (the frame's, a record's) hold at most MAX_FIELDS
    # fields besides the frame's own keys, each name at most MAX_KEY_CHARS characters
    wide = {f"k{i}": 0 for i in range(MAX_FIELDS + 1)}
    wider = wide | {"k_last": 0}  # with the frame's "v", "t" and "m": one past what it may hold
    with pytest.raises(
        MalformedMessage, match=f"frame: expected a map of at most {MAX_FIELDS + 4}"
    ):
        decode_frame(pack(frame_of(Heartbeat()) | wider))
    assert len(frame_of(Heartbeat()) | wider) == MAX_FIELDS + 5
    goes_on = next(d for d in examples(MESSAGE_TYPES["decision"]) if d.go is not None)
    frame = frame_of(goes_on)
    frame["go"] |= wide
    with pytest.raises(MalformedMessage, match=r"decision\.go: expected a map of at most"):
        decode_frame(pack(frame))
    with pytest.raises(
        MalformedMessage, match=f"a field name must be a string of at most {MAX_KEY_CHARS}"
    ):
        decode_frame(pack(frame_of(Heartbeat()) | {"k" * (MAX_KEY_CHARS + 1): 0}))


def test_an_unknown_fields_value_nested_past_the_decoders_depth_is_refused():
    deep = b"\x91" * 5000 + b"\x90"  # five thousand lists, each the only item of the last
    data = _raw_frame(("v", PROTOCOL_VERSION), ("t", "heartbeat")) + b""
    data = bytes([data[0] + 1]) + data[1:] + pack("later") + deep
    assert len(data) <= MAX_FRAME_BYTES
    with pytest.raises(MalformedMessage, match="nest too deep"):
        decode_frame(data)


def test_the_unknown_fields_of_the_frame_and_of_each_record_are_named():
    goes_on = max(
        (d for d in examples(MESSAGE_TYPES["decision"]) if d.go is not None),
        key=lambda d: len(d.train_metrics),
    )
    half = [0] * 100
    frame = frame_of(goes_on) | {"m": NEWER, "a": half, "b": {"x": half}}
    frame["go"]["b"] = half
    for metric in frame["train_metrics"]:
        metric["c"] = half
    data = pack(frame)
    assert len(frame["train_metrics"]) > 2
    expected = ("decision.a", "decision.b", "decision.go.b", "decision.train_metrics.c")
    assert decode_frame(data) == Decoded(goes_on, minor=NEWER, skipped=expected)


@pytest.mark.parametrize("shape", ["nested empty lists", "empty maps", "small ints"])
def test_a_frame_full_of_unknown_values_is_skipped_building_nothing(shape: str):
    # as many values as a frame holds, in a field this version does not know: nothing is built
    # of them, so decoding allocates about what the message itself takes, however many they are
    filler = {"nested empty lists": b"\x91\x90", "empty maps": b"\x80", "small ints": b"\x01"}[
        shape
    ]
    head = _raw_frame(("v", PROTOCOL_VERSION), ("t", "heartbeat"))
    head = bytes([head[0] + 1]) + head[1:] + pack("later")
    rows = (MAX_FRAME_BYTES - len(head) - 3) // len(filler)
    data = head + b"\xdc" + rows.to_bytes(2, "big") + filler * rows
    assert len(data) <= MAX_FRAME_BYTES
    tracemalloc.start()
    try:
        assert decode_frame(data) == Decoded(Heartbeat(), skipped=("heartbeat.later",))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * MAX_FRAME_BYTES, f"decoding allocated {peak} bytes at its peak"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages, st.dictionaries(st.text(max_size=8), msgpack_objects, max_size=3))
def test_any_unknown_fields_are_skipped_and_named(message: Any, extra: dict[str, Any]):
    frame = frame_of(message) | {"m": NEWER}
    declared = {spec.name for spec in fields_of(type(message))} | {"v", "t", "m", "s"}
    unknown = {k: v for k, v in extra.items() if k not in declared}
    paths = tuple(sorted(f"{TYPE_NAMES[type(message)]}.{k}" for k in unknown))
    assert decode_frame(pack(frame | unknown)) == Decoded(message, "", NEWER, paths)


# ----------------------------------------------------------------------------- logging once


def test_each_skipped_field_is_told_once_escaped_and_a_flood_of_names_is_cut():
    told = SkippedFields("worker")
    first = Decoded(Heartbeat(), minor=NEWER, skipped=("heartbeat.later", "heartbeat.x\n\x1b"))
    lines = told.news(first)
    assert len(lines) == 2 and all(line.isprintable() for line in lines)
    assert f"peer of protocol version {PROTOCOL_VERSION}.{NEWER}" in lines[0]
    assert "'heartbeat.later'" in lines[0] and "this worker speaks" in lines[0]
    assert "'heartbeat.x\\n\\x1b'" in lines[1]
    assert told.news(first) == []  # once each, however many frames carry them
    names = tuple(f"heartbeat.f{i}" for i in range(2 * MAX_TOLD))
    lines = told.news(Decoded(Heartbeat(), minor=NEWER, skipped=names))
    assert len(lines) == MAX_TOLD - 2 + 1 and "further ones are skipped" in lines[-1]
    assert told.news(Decoded(Heartbeat(), skipped=("heartbeat.new",))) == []
    assert len(told.told) == MAX_TOLD


# ----------------------------------------------------------------------------- the rule

MAJOR = 6
"""The major version whose required fields :data:`REQUIRED` lists."""

REQUIRED: dict[str, tuple[str, ...]] = {
    "hello": ("job", "token", "worker_id", "host", "pid", "rank_hint", "device", "fingerprint"),
    "store_ready": ("host", "port"),
    "epoch_ready": ("epoch", "train_batches", "valid_batches"),
    "epoch_report": ("epoch", "train_loss_sum", "train_count", "valid_loss_sum", "valid_count"),
    "checkpointed": ("epoch",),
    "failed": ("reason",),
    "broken": ("epoch", "generation", "reason"),
    "done": (),
    "status": ("phase", "epoch", "step", "where"),
    "model_page": ("first", "entries", "params"),
    "heartbeat": (),
    "open_store": ("run_id",),
    "welcome": (
        "rank",
        "world_size",
        "run_id",
        "backend",
        "store_host",
        "store_port",
        "start_epoch",
        "epochs",
        "resume_epoch",
        "checkpoint_dir",
        "session",
        "liveness",
    ),
    "joined": ("joined", "world_size", "session", "liveness"),
    "reject": ("reason", "code"),
    "go": ("epoch", "train_batches", "valid_batches", "lr_factor"),
    "decision": (
        "epoch",
        "train_loss",
        "valid_loss",
        "smoothed_loss",
        "best_epoch",
        "is_best",
        "checkpoint",
        "stop",
    ),
    "finish": ("best_epoch", "best_loss", "epochs_run", "restore_best"),
    "regroup": ("generation", "epoch"),
    "abort": ("reason",),
    "describe_model": ("first",),
    # the records messages are made of
    "Fingerprint": ("digest", "torch_version", "entries"),
    "Liveness": (),
    "Metric": ("name", "total", "count"),
    "ParamSpec": ("name", "shape", "dtype"),
    "StepRates": ("warmup", "steps"),
}
"""Every message type of major version :data:`MAJOR` and the fields each requires (those without
a default), and those of the records inside them: what a peer of any minor version of the major
version sends and understands."""


def _parts(cls: type, found: dict[str, type]) -> None:
    for spec in fields_of(cls):
        kind = spec.item.kind if spec.item is not None else spec.kind
        messages = MESSAGE_TYPES.values()
        if isinstance(kind, type) and issubclass(kind, Record) and kind not in messages:
            found[kind.__name__] = kind
            _parts(kind, found)


def test_a_new_message_or_a_field_without_a_default_is_a_major_bump():
    assert PROTOCOL_VERSION == MAJOR, (
        f"major version {PROTOCOL_VERSION}: write down its message types and required fields "
        "in REQUIRED (and MAJOR)"
    )
    declared: dict[str, type] = dict(MESSAGE_TYPES)
    for cls in MESSAGE_TYPES.values():
        _parts(cls, declared)
    added = {name for name in set(declared) - set(REQUIRED) if not declared[name].optional}
    assert set(REQUIRED) <= set(declared) and not added, (
        f"{sorted(added) or sorted(set(REQUIRED) - set(declared))}: a message type (or record) "
        "added or removed within a major version: peers of its other minor versions would refuse "
        "it; make a new message type optional (optional = True), or bump PROTOCOL_VERSION"
    )
    for name in REQUIRED:
        cls = declared[name]
        required = tuple(spec.name for spec in fields_of(cls) if spec.required)
        assert required == REQUIRED[name], (
            f"{name}: a field without a default, or one removed, within a major version; give a "
            "new field a default and bump PROTOCOL_MINOR, or bump PROTOCOL_VERSION"
        )
