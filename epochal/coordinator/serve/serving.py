"""One turn of the coordinator service's loop over received frames: a bounded batch handed on.

The service polls its socket, then hands on the frames its :class:`~.inbox.Inbox` holds, a batch
at a time (:func:`hand_on`): at most :data:`BATCH` frames or :data:`BATCH_SECONDS`, so that a
flood of frames cannot starve the heartbeats and the clock, reading every frame libzmq holds out
into the inbox every :data:`DRAIN_EVERY` frames. The bounds of the inbox itself are here too
(:func:`open_inbox`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import zmq

from epochal.coordinator.serve.inbox import Inbox

BATCH = 256
"""Frames handled before the service looks at its clock again."""

DRAIN_EVERY = 32
"""Frames handed on between two reads of every frame libzmq holds (:mod:`.inbox`)."""

INBOX_FRAMES = 1024
INBOX_FRAMES_PER_WORKER = 4
"""The inbox holds at most this many frames per worker (and at least INBOX_FRAMES): an epoch's
burst is a Status or two and a loss report from every rank."""

INBOX_BYTES = 32 * 1024 * 1024
"""The most bytes of frames the inbox holds: past that, frames wait in libzmq."""

BATCH_SECONDS = 0.05
"""Longest a batch of frames may keep the service from its clock (one frame may overrun it)."""


def open_inbox(
    io: zmq.Socket[Any], *, read: Callable[[list[Any]], None], secured: bool, workers: int
) -> Inbox:
    """The inbox of the socket ``io`` for a run of ``workers``, bounded as above; ``read`` is
    told of each message as it leaves libzmq."""
    return Inbox(
        io,
        read=read,
        secured=secured,
        most_frames=max(INBOX_FRAMES, INBOX_FRAMES_PER_WORKER * workers),
        most_bytes=INBOX_BYTES,
    )


async def hand_on(
    inbox: Inbox,
    handle: Callable[[list[Any], float], Awaitable[bool]],
    *,
    drained: bool,
) -> bool:
    """Hand the frames ``inbox`` holds (and those libzmq holds, read out as it goes) to
    ``handle(frames, now)`` one at a time, a bounded batch, stopping early once it says the run
    has ended; return whether libzmq held no finished message at its last read (``drained`` if
    none)."""
    batch_end = time.monotonic() + BATCH_SECONDS
    for handed in range(BATCH):
        if handed % DRAIN_EVERY == 0:  # out of libzmq's buffers (see .inbox)
            drained = inbox.drain()
        frames = inbox.pop()
        if frames is None:  # all that was queued
            break
        if await handle(frames, time.monotonic()) or time.monotonic() > batch_end:
            break
    return drained
