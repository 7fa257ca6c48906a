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
