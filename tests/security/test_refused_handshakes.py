"""A coordinator logs the CURVE handshakes it refuses, and its rendezvous timeout names them.

The rate limit is a pure rule, table-tested with a given clock; the logging itself runs a real
coordinator with a real ZAP authenticator and a DEALER holding a key that is not on the list.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import zmq
import zmq.asyncio

from epochal.coordinator import Coordinator, CoordinatorConfig
from epochal.errors import RunAborted
from epochal.protocol import Hello, encode
from epochal.protocol.messages import Fingerprint
from epochal.security import ClientSecurity, KeyDirectory, ServerSecurity, secure_client
from epochal.security.curvekeys import REFUSED_KEYS_LOGGED, RefusedHandshakes

pytestmark = pytest.mark.timeout(60)

A, B = b"A" * 40, b"B" * 40


def test_each_key_is_logged_once_a_minute_and_the_rest_counted():
    refused = RefusedHandshakes()
    first = refused.refused(A, now=0.0)
    assert first is not None and "worker key " + "A" * 40 + " is not on the allow-list" in first
    assert refused.refused(A, now=1.0) is None  # the same key retrying: counted, not logged
    assert refused.refused(B, now=2.0) is not None  # another key: logged
    assert refused.refused(A, now=59.0) is None
    again = refused.refused(A, now=60.0)  # a new minute
    assert again is not None and "(2 more refused handshakes in the minute before)" in again
    assert refused.total == 5


def test_at_most_so_many_lines_a_minute_whatever_the_keys():
    refused = RefusedHandshakes()
    lines = [refused.refused(b"%040d" % i, now=float(i) / 1000) for i in range(1000)]
    assert sum(line is not None for line in lines) == REFUSED_KEYS_LOGGED
    assert refused.total == 1000


def test_no_refusal_adds_nothing_to_the_rendezvous_timeout():
    assert RefusedHandshakes().rendezvous_note() == ""


async def test_a_refused_key_is_logged_and_named_by_the_rendezvous_timeout(keydir: KeyDirectory):
    log: list[str] = []
    security = ServerSecurity.from_paths(keydir.coordinator_secret, keydir.allowed)
    config = CoordinatorConfig(world_size=1, epochs=1, rendezvous_timeout=3.0)
    coordinator = Coordinator(config, security=security, log=log.append)
    endpoint = await coordinator.start()
    task = asyncio.create_task(coordinator.run())

    public, secret = zmq.curve_keypair()
    outsider = ClientSecurity(public=public, secret=secret, server_public=security.public)
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    secure_client(dealer, outsider)
    dealer.connect(endpoint)
    fingerprint = Fingerprint(digest="d", torch_version="x", entries=0)
    try:
        # the refusal comes with the handshake, which needs no frame; and once a handshake was
        # refused, libzmq (4.3) drops the pipe and a send waits for another: a send that waited
        # would outlast the coordinator's abort, and with it every timer of the loop
        with contextlib.suppress(zmq.Again):
            hello = Hello("epochal", "", "mallory", "h", 1, None, "cpu", fingerprint)
            await dealer.send(encode(hello), zmq.NOBLOCK)
        with pytest.raises(RunAborted) as info:
            await asyncio.wait_for(task, config.rendezvous_timeout + 20)
        assert not await dealer.poll(100)  # the outsider heard nothing: not even the abort
    finally:
        dealer.close(linger=0)
        ctx.term()
        if not task.done():
            task.cancel()

    refusals = [line for line in log if public.decode() in line]
    assert len(refusals) == 1, log  # the outsider keeps retrying: logged once
    assert refusals[0].startswith("refused a CURVE handshake: worker key ")
    reason = info.value.reason
    assert reason.startswith("only 0 of 1 workers joined within 3 s")
    assert "CURVE handshakes were refused meanwhile (logged above)" in reason
    assert "(--curve-allowed)" in reason
