"""``bench/codec.py`` times one frame of every registered message: a new message needs nothing
there (its example is derived), and every example it times is one the codec takes back."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from epochal.protocol import decode, encode
from epochal.protocol.messages import MESSAGE_TYPES

BENCH = Path(__file__).resolve().parents[2] / "bench" / "codec.py"


def bench_codec() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_codec", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_codec_bench_times_every_registered_message_and_each_round_trips() -> None:
    frames = bench_codec().examples(10)
    timed = {name for name in frames if name in MESSAGE_TYPES}
    assert timed == set(MESSAGE_TYPES)
    for name, message in frames.items():
        assert decode(encode(message)) == message, name
    assert len(frames["model_page (10 params)"].params) == 10


def test_the_hostile_frames_are_the_frames_they_are_named() -> None:
    """Each hostile frame the bench times is as large as a frame may be and reaches the part of
    the decoder its name says: a hello whose trailing unknown field is skipped, or a refusal for
    the reason it is built for (a header miscounted would make them all cheap refusals)."""
    from epochal.errors import MalformedMessage
    from epochal.protocol import MAX_FRAME_BYTES, Hello
    from epochal.protocol.codec import decode_frame

    refused = {
        "deep nesting": "nest too deep",
        "dense, then bad type": "hello.pid: expected int, got str",
        "not msgpack": "not a msgpack frame",
        "a list, not a map": "frame: expected a map, got list",
    }
    for name, data in bench_codec().hostile().items():
        assert MAX_FRAME_BYTES - 4096 < len(data) <= MAX_FRAME_BYTES, name
        if name in refused:
            try:
                decode_frame(data)
            except MalformedMessage as exc:
                assert refused[name] in str(exc), (name, str(exc))
            else:
                raise AssertionError(f"{name}: decoded")
            continue
        decoded = decode_frame(data)
        assert isinstance(decoded.message, Hello), name
        assert decoded.skipped == (
            ("hello.params",) if name == "largest hello" else ("hello.later",)
        )
