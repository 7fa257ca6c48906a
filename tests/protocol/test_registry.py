"""A message is one class: @message registers it, and the codec and exports follow from that."""

from __future__ import annotations

import dataclasses
import types
from typing import Annotated

import msgpack
import pytest

import epochal.protocol
from epochal.errors import MalformedMessage
from epochal.protocol import decode, encode
from epochal.protocol.messages import (
    MAX_LIST_ITEMS,
    MAX_METRICS,
    MESSAGE_TYPES,
    OPTIONAL_TYPES,
    TYPE_NAMES,
    CoordinatorMessage,
    Heartbeat,
    Items,
    Message,
    Metric,
    Name,
    NonNeg,
    Record,
    Text,
    WorkerMessage,
    fields_of,
    message,
    names_sent_by,
    understood,
    wire_name,
)
from tests.protocol.examples import CannotDerive, examples


@pytest.mark.parametrize(
    ("cls", "name"),
    [("Hello", "hello"), ("EpochReady", "epoch_ready"), ("OpenStore", "open_store"), ("Go", "go")],
)
def test_the_wire_name_is_the_class_name_in_snake_case(cls: str, name: str):
    assert wire_name(cls) == name
    assert TYPE_NAMES[getattr(epochal.protocol, cls)] == name


def test_every_message_is_a_frozen_slotted_dataclass_of_one_side_or_both():
    for name, cls in MESSAGE_TYPES.items():
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
        assert "__slots__" in vars(cls), name
        assert issubclass(cls, WorkerMessage | CoordinatorMessage), name
    both = set(names_sent_by(WorkerMessage)) & set(names_sent_by(CoordinatorMessage))
    assert both == {"heartbeat"} and issubclass(Heartbeat, Message)


def test_the_package_exports_every_message_and_no_module_it_imported():
    for cls in MESSAGE_TYPES.values():
        assert getattr(epochal.protocol, cls.__name__) is cls
    for name, value in vars(epochal.protocol).items():
        if isinstance(value, types.ModuleType) and not name.startswith("_"):
            assert value.__name__.startswith("epochal.protocol."), name


def test_a_new_message_is_one_class(registry: None):
    @message
    class PingBack(WorkerMessage):
        count: NonNeg
        note: Text

    assert MESSAGE_TYPES["ping_back"] is PingBack
    assert "ping_back" in names_sent_by(WorkerMessage)
    ping = PingBack(count=3, note="hi")
    assert decode(encode(ping, session="abc")) == ping
    with pytest.raises(ValueError, match="count must be >= 0, got -1"):
        PingBack(count=-1, note="hi")
    frame = encode(ping).replace(b"\xa5count\x03", b"\xa5count\xff")  # -1
    with pytest.raises(MalformedMessage, match="ping_back: count must be >= 0, got -1"):
        decode(frame)
    # the codec tests' examples follow from the declaration too: none is written for it
    derived = examples(PingBack)
    assert {m.count for m in derived} == {0, 2**64 - 1}
    assert all(decode(encode(m)) == m for m in derived)


def test_a_list_field_declares_its_bound_and_the_codec_holds_it(registry: None):
    @message
    class Scores(WorkerMessage):
        scores: Annotated[tuple[Metric, ...], Items(3)]
        tags: Annotated[tuple[str, ...], Items(MAX_METRICS)] = ()

    (spec, tags) = fields_of(Scores)
    assert (spec.max_items, spec.item and spec.item.kind) == (3, Metric)
    assert (tags.max_items, tags.required, tags.default) == (MAX_METRICS, False, ())
    scores = tuple(Metric(f"m{i}", 1.0, 1) for i in range(3))
    assert decode(encode(Scores(scores))) == Scores(scores)
    with pytest.raises(ValueError, match="scores holds 4 items, at most 3 allowed"):
        Scores((*scores, Metric("m3", 1.0, 1)))
    frame = msgpack.unpackb(encode(Scores(scores)))
    frame["scores"].append({"name": "m3", "total": 1.0, "count": 1})
    with pytest.raises(MalformedMessage, match=r"scores: expected a list of at most 3 items"):
        decode(msgpack.packb(frame))


@dataclasses.dataclass(frozen=True, slots=True)
class Part(Record):
    """A record with a list that declares no bound (never part of a registered message)."""

    sizes: tuple[int, ...]


def test_a_list_field_without_a_bound_is_refused_where_it_is_declared(registry: None):
    with pytest.raises(TypeError, match=r"Unbounded.names: a list field declares its bound"):

        @message
        class Unbounded(WorkerMessage):
            names: tuple[str, ...]

    with pytest.raises(TypeError, match=r"Part.sizes: a list field declares its bound"):

        @message
        class Holder(CoordinatorMessage):  # a record inside fails where its user is declared
            part: Part

    assert "unbounded" not in MESSAGE_TYPES and "holder" not in MESSAGE_TYPES


@pytest.mark.parametrize(
    ("annotation", "expected"),
    [
        (Annotated[int, Items(3)], "Items bounds a list"),
        (Annotated[tuple[int, ...], Items(3), Items(4)], "declares its bound on its type, once"),
        (dict[str, int], "cannot be of type"),
    ],
)
def test_a_field_the_codec_cannot_carry_is_refused_where_it_is_declared(
    registry: None, annotation: object, expected: str
):
    with pytest.raises(TypeError, match=expected):
        message(type("Odd", (WorkerMessage,), {"__annotations__": {"odd": annotation}}))


def test_a_list_bound_is_at_most_what_any_frame_holds():
    assert Items(MAX_LIST_ITEMS).most == MAX_LIST_ITEMS
    with pytest.raises(TypeError, match=rf"a list holds 0..{MAX_LIST_ITEMS} items"):
        Items(MAX_LIST_ITEMS + 1)


@pytest.mark.parametrize("key", ["v", "t", "m", "s"])
def test_a_field_cannot_take_the_name_of_a_frames_own_key(registry: None, key: str):
    with pytest.raises(TypeError, match=f"{key} is a frame's own key"):
        message(type("Clash", (WorkerMessage,), {"__annotations__": {key: Name}}))


def test_a_default_is_a_value_not_a_factory(registry: None):
    with pytest.raises(TypeError, match="a default value, not a factory"):

        @message
        class Factory(WorkerMessage):
            note: Text = dataclasses.field(default_factory=lambda: "x")


def test_a_message_whose_examples_cannot_be_derived_names_itself(registry: None):
    # a check between fields is not declared on the types: the derived values may break it, and
    # then the round trip over every registered message fails, naming the message
    @message
    class Window(WorkerMessage):
        first: NonNeg
        last: NonNeg

        def _validate(self) -> None:
            if self.last <= self.first:
                raise ValueError("last not after first")

    with pytest.raises(CannotDerive, match=r"Window: .*last not after first.*AGREE"):
        examples(Window)


def test_a_message_must_say_who_sends_it(registry: None):
    with pytest.raises(TypeError, match="must derive from WorkerMessage or CoordinatorMessage"):

        @message
        class Stray(Message):
            pass


def test_two_messages_cannot_share_a_name(registry: None):
    with pytest.raises(TypeError, match="two messages are named 'heartbeat'"):

        @message
        class Heartbeat(CoordinatorMessage):
            pass


def test_an_optional_message_is_one_its_peers_say_they_understand(registry: None):
    @message
    class Whisper(WorkerMessage):
        optional = True
        note: Text

    assert "whisper" in OPTIONAL_TYPES and "whisper" in understood()
    assert not MESSAGE_TYPES["hello"].optional and "hello" not in understood()
    assert decode(encode(Whisper(note="hi"))) == Whisper(note="hi")  # a message like any other
