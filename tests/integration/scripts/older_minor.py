"""linear.py run by a worker one minor protocol version older than this one.

Every frame its control client sends is made as the previous minor version makes it: ``m`` one
less, and without the fields this minor version added (:data:`ADDED`). The coordinator it talks to
is this version's: the test runs a whole elastic run of such workers.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any

import msgpack

from epochal.protocol import PROTOCOL_MINOR, codec
from epochal.worker.control import client

ADDED = {"hello": ("understands",)}
"""The fields each message gained in this minor version (6.5): what a 6.4 worker never sends."""

LINEAR = Path(__file__).with_name("linear.py")


def older_encode(message: Any, session: str = "") -> bytes:
    frame = msgpack.unpackb(codec.encode(message, session=session))
    frame["m"] = PROTOCOL_MINOR - 1
    for field in ADDED.get(frame["t"], ()):
        del frame[field]
    data: bytes = msgpack.packb(frame)
    return data


client.encode = older_encode  # type: ignore[assignment]
sys.argv = [str(LINEAR), *sys.argv[1:]]
runpy.run_path(str(LINEAR), run_name="__main__")
