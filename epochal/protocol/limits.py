"""How much one frame may make its reader allocate, whoever sent it.

The frame size alone bounds little: 64 KiB of nested empty arrays would decode to a few MiB of
Python objects. So the codec reads a frame against the declared fields of its message and counts
every value it reads; these are the bounds it enforces, each sized to the largest legitimate
message.
"""

from __future__ import annotations

from epochal.protocol.messages import (
    MAX_FRAME_BYTES,
    MAX_METRICS,
    MAX_PAGE_PARAMS,
    MAX_SHAPE_DIMS,
)

SESSION_KEY = "s"
"""Frame key of the session a worker presents with every frame after its hello was admitted.

At most :data:`~epochal.protocol.messages.MAX_SESSION_CHARS` characters."""

MAX_KEY_CHARS = 64
"""Longest field name; every declared one is far shorter."""

MAX_FIELDS = 16
"""Most fields any message declares (Welcome has 12), beyond the reserved ``v``, ``t``, ``s``."""

LIST_LIMITS: dict[str, int] = {
    "params": MAX_PAGE_PARAMS,
    "shape": MAX_SHAPE_DIMS,
    "train_metrics": MAX_METRICS,
    "valid_metrics": MAX_METRICS,
}
"""Most items of each list-valued field, by field name; a list anywhere else is refused."""

MAX_LIST_ITEMS = max(LIST_LIMITS.values())
"""Longest list any frame may hold."""

MAX_FRAME_OBJECTS = MAX_FRAME_BYTES
"""Most values (maps, lists, strings, numbers) one frame may hold: a value takes at least a byte,
so no frame within the size limit holds more; the value-by-value reader still counts them."""

WHOLE_FRAME_BYTES = MAX_FRAME_BYTES
"""Frames up to this size are unpacked whole, then checked against their message; a frame that
fails there is read again value by value, to name what is wrong. A whole frame of this size holds
at most this many values (the worst, an empty map per byte, is about 72 bytes of objects per
byte), so unpacking it costs under 5 MiB of transient objects whatever the bytes."""
