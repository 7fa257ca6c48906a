"""A message is one class: @message registers it, and the codec and exports follow from that."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterator

import pytest

import epochal.protocol
from epochal.errors import MalformedMessage
from epochal.protocol import decode, encode
from epochal.protocol.messages import (
    MESSAGE_TYPES,
    TYPE_NAMES,
    CoordinatorMessage,
    Heartbeat,
    Message,
    NonNeg,
    Text,
    WorkerMessage,
    message,
    names_sent_by,
    wire_name,
)


@pytest.fixture
def registry() -> Iterator[None]:
    """Messages defined by a test are forgotten after it."""
    saved = dict(MESSAGE_TYPES), dict(TYPE_NAMES)
    yield
    MESSAGE_TYPES.clear()
    MESSAGE_TYPES.update(saved[0])
    TYPE_NAMES.clear()
    TYPE_NAMES.update(saved[1])


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
