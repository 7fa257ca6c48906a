"""The rule on what libzmq may hold of a connection: its counts and limits, without sockets; and
the counts it relies on (a frame's bytes on the wire, the handshake's), on real sockets."""

from __future__ import annotations

import struct
import time

import pytest
import zmq

from epochal.coordinator.rules.holding import (
    HANDSHAKE_BYTES,
    LONG_HEAD_BYTES,
    GiveBack,
    Held,
    Holdings,
    MemoryWatch,
    hold_limits,
    largest_message,
    wire_bytes,
)
from epochal.coordinator.serve import kernel
from epochal.protocol import MAX_FRAME_BYTES
from tests.security.crowd import zmtp_dealer

HWM = 64
SETTLE = 5.0
"""Seconds libzmq's I/O thread may take to read what a peer sent (a deadline, not a wait)."""


@pytest.mark.parametrize(
    ("size", "secured", "wire"),
    [
        (0, False, 2),
        (255, False, 257),  # the longest short frame
        (256, False, 256 + LONG_HEAD_BYTES),
        (222, True, 222 + 33 + 2),  # CURVE's 33 bytes go in the frame: still short
        (223, True, 223 + 33 + LONG_HEAD_BYTES),
        (MAX_FRAME_BYTES, False, MAX_FRAME_BYTES + LONG_HEAD_BYTES),
    ],
)
def test_a_frames_bytes_on_the_wire(size, secured, wire):
    assert wire_bytes(size, secured) == wire


def test_the_limits_are_the_handshake_a_frame_in_progress_and_the_messages_libzmq_may_queue():
    for secured in (False, True):
        largest = largest_message(secured)
        limits = hold_limits(HWM, secured)
        assert limits.drained == HANDSHAKE_BYTES + 2 * largest
        assert limits.queued == limits.drained + HWM * largest


def test_a_connection_is_over_only_past_the_limit_that_applies():
    limits = hold_limits(HWM, False)
    h = Holdings(limits)
    h.handed(5, 1000)
    h.handed(6, 1000)
    readings = [(5, 1000 + limits.drained), (6, 1000 + limits.drained + 1)]
    assert h.over(readings, drained=True) == [Held(6, limits.drained + 1)]
    # while finished messages may still be queued, the same bytes are within the bound
    assert h.over(readings, drained=False) == []
    assert h.over([(6, 1000 + limits.queued + 1)], drained=False) == [Held(6, limits.queued + 1)]


def test_frames_handed_count_against_their_own_connection_only():
    limits = hold_limits(HWM, False)
    h = Holdings(limits)
    for _ in range(100):
        h.handed(5, largest_message(False))
    read = 100 * largest_message(False) + 300  # all handed, and a handshake
    assert h.over([(5, read)], drained=True) == []
    assert h.over([(6, read)], drained=True) == [Held(6, read)]  # nothing handed from 6


def test_a_reused_descriptor_gets_no_credit_from_its_previous_connection():
    limits = hold_limits(HWM, False)
    h = Holdings(limits)
    h.handed(5, 10 * largest_message(False))  # frames of the old connection, read late
    assert h.held(5, 300) == 0  # the new connection read its handshake: no less than nothing
    assert h.over([(5, 300 + limits.drained + 1)], drained=True) == [Held(5, limits.drained + 1)]


def test_a_closed_connection_is_forgotten():
    h = Holdings(hold_limits(HWM, False))
    h.handed(5, 1000)
    h.closed(5)
    assert h.held(5, 1000) == 1000


@pytest.mark.parametrize(
    ("resident", "due"),
    [
        # the first look sets the mark
        ([100], [False]),
        ([100, 115, 116], [False, False, True]),
        # the mark follows the lowest, then moves to where a look happened
        ([100, 50, 65, 66, 81, 82], [False, False, False, True, False, True]),
        ([None, 100, None, 200], [False, False, False, True]),
    ],
)
def test_every_connection_is_looked_at_once_memory_grew_by_the_step(resident, due):
    watch = MemoryWatch(step=16)
    assert [watch.due(r) for r in resident] == due


def test_memory_is_given_back_after_a_drop_at_most_once_an_interval():
    give = GiveBack(interval=1.0)
    assert not give.due(0.0)  # nothing freed
    give.freed()
    assert give.due(0.0)
    assert not give.due(0.1)  # done
    give.freed()
    assert not give.due(0.5)  # too soon after the last
    assert give.due(1.0)
    assert not give.due(5.0)


# ---------------------------------------------------------------------- on real sockets


def _pair(ctx: zmq.Context, secured: bool) -> tuple[zmq.Socket, zmq.Socket]:
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for sock in (router, dealer):
        sock.setsockopt(zmq.LINGER, 0)
    if secured:
        server_public, server_secret = zmq.curve_keypair()
        public, secret = zmq.curve_keypair()
        router.curve_server = True
        router.curve_secretkey = server_secret
        dealer.curve_serverkey = server_public
        dealer.curve_publickey = public
        dealer.curve_secretkey = secret
    dealer.setsockopt(zmq.IDENTITY, b"w" * 255)  # the longest routing id
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    return router, dealer


@pytest.mark.parametrize("secured", [False, True], ids=["null", "curve"])
def test_a_libzmq_dealers_handshake_and_frames_are_counted_exactly(secured):
    """What the ROUTER's I/O thread read of a libzmq DEALER is its handshake (within the
    allowance) and the bytes on the wire of the frames handed over, to the byte."""
    ctx = zmq.Context()
    router, dealer = _pair(ctx, secured)
    try:
        holdings = Holdings(hold_limits(HWM, secured))
        for size in (0, 1, 222, 223, 255, 256, 4000, MAX_FRAME_BYTES):
            dealer.send(b"x" * size)
            assert router.poll(int(SETTLE * 1000)), "the DEALER's frame never came"
            frames = router.recv_multipart(copy=False)
            holdings.handed(frames[1].get(zmq.SRCFD), wire_bytes(len(frames[1]), secured))
        fd = frames[1].get(zmq.SRCFD)
        read = kernel.bytes_read(fd)
        assert read is not None
        handshake = holdings.held(fd, read)
        assert 64 < handshake <= HANDSHAKE_BYTES, handshake  # the greeting and the commands
        assert holdings.over([(fd, read)], drained=True) == []
    finally:
        router.close(0)
        dealer.close(0)
        ctx.term()


def test_frames_flagged_more_are_held_by_libzmq_and_seen_past_the_limit():
    """A peer that sends frames flagged "more" and never the last (raw ZMTP: a libzmq DEALER
    sends nothing of a message before its last frame): the ROUTER hands nothing over, and what
    its I/O thread read passes the limit."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    peer = zmtp_dealer(f"tcp://127.0.0.1:{port}")
    try:
        peer.sendall(b"\x00\x05hello")  # a finished message, to learn the descriptor
        assert router.poll(int(SETTLE * 1000)), "the peer's first message never came"
        frames = router.recv_multipart(copy=False)
        fd = frames[1].get(zmq.SRCFD)
        holdings = Holdings(hold_limits(HWM, False))
        holdings.handed(fd, wire_bytes(len(frames[1]), False))
        count = 3
        more = b"\x03" + struct.pack(">Q", MAX_FRAME_BYTES) + bytes(MAX_FRAME_BYTES)
        peer.sendall(more * count)
        sent = count * wire_bytes(MAX_FRAME_BYTES, False)
        deadline = time.monotonic() + SETTLE
        read = kernel.bytes_read(fd)
        while read is not None and holdings.held(fd, read) < sent:
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)  # the I/O thread reads what was sent at its own pace
            read = kernel.bytes_read(fd)
        assert read is not None
        assert router.poll(0) == 0  # nothing to read: the message is not finished
        over = holdings.over([(fd, read)], drained=True)
        assert over == [Held(fd, holdings.held(fd, read))], (over, holdings.limits)
        assert over[0].held >= sent
    finally:
        peer.close()
        router.close(0)
        ctx.term()
