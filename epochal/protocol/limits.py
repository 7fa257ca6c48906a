"""How much one frame may make its reader allocate, whoever sent it.

The frame size alone bounds nothing useful: 16 MiB of nested empty arrays would decode to about a
gigabyte of Python objects. So the codec reads a frame against the declared fields of its message
and counts every value it reads; these are the bounds it enforces, each sized to the largest
legitimate message (a hello whose fingerprint lists :data:`MAX_PARAMS` parameters).
"""

from __future__ import annotations

from epochal.protocol.messages import MAX_METRICS, MAX_PARAMS, MAX_SHAPE_DIMS

SESSION_KEY = "s"
"""Frame key of the session a worker presents with every frame after its hello was admitted.

At most :data:`~epochal.protocol.messages.MAX_SESSION_CHARS` characters."""

MAX_KEY_CHARS = 64
"""Longest field name; every declared one is far shorter."""

MAX_FIELDS = 16
"""Most fields any message declares (Welcome has 11), beyond the reserved ``v``, ``t``, ``s``."""

LIST_LIMITS: dict[str, int] = {
    "params": MAX_PARAMS,
    "shape": MAX_SHAPE_DIMS,
    "train_metrics": MAX_METRICS,
    "valid_metrics": MAX_METRICS,
}
"""Most items of each list-valued field, by field name; a list anywhere else is refused."""

MAX_FRAME_OBJECTS = 12 * MAX_PARAMS
"""Most values (maps, lists, strings, numbers) one frame may hold: enough for a fingerprint of
:data:`MAX_PARAMS` parameters of four dimensions each (about 11 values per parameter), and a bound
of a few hundred MiB of transient objects whatever the bytes."""

WHOLE_FRAME_BYTES = 64 * 1024
"""Frames up to this size are unpacked whole, then checked against their message; larger ones are
read value by value. A whole frame of this size holds at most this many values (the worst, an
empty map per byte, is about 72 bytes of objects per byte), so unpacking it costs under 5 MiB of
transient objects whatever the bytes: the bound above still holds."""
