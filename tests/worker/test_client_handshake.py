"""A coordinator that accepts a connection but never completes the handshake "does not answer".

A plain TCP socket that listens and never writes stands for a coordinator that is stopped,
overloaded or out of file descriptors: the kernel accepts the connection, nothing speaks ZeroMQ.
The worker must say, in one line, that the coordinator at that address does not answer and for
how long, blaming CURVE only when CURVE is on (where it adds the key hint), and never claim that
the coordinator requires CURVE. These tests shorten the client's handshake interval (libzmq's 30 s)
so that the handshake really times out, more than once, before the connect deadline: that timeout
is what was taken for a CURVE refusal.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator

import pytest
import zmq

from epochal.environment import CURVE_SERVER_KEY_ENV
from epochal.errors import CoordinatorUnreachable
from epochal.protocol import Fingerprint
from epochal.security.curvekeys import ClientSecurity, describe_handshake_failure
from epochal.worker.control import client as client_module
from epochal.worker.control.admission import rendezvous
from epochal.worker.control.client import ControlClient
from epochal.worker.control.waiting import Handshake
from epochal.worker.joinoptions import JoinOptions
from tests.conftest import hello

HANDSHAKE_TIMEOUT = 0.5
"""The client's handshake interval in these tests."""

CONNECT_DEADLINE = 4 * HANDSHAKE_TIMEOUT + 1.0
"""Past several handshake timeouts, so the worker sees how they end."""

HELLO = hello("w-handshake", Fingerprint(digest="d" * 64, torch_version="x", entries=0), host="h")


@pytest.fixture
def silent() -> Iterator[str]:
    """A listening TCP socket that accepts connections (the kernel does) and never answers."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    try:
        yield f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


@pytest.fixture(autouse=True)
def short_handshakes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "HANDSHAKE_TIMEOUT", HANDSHAKE_TIMEOUT)


def unreachable_line(endpoint: str, security: ClientSecurity | None) -> str:
    client = ControlClient(
        endpoint, b"w-handshake", JoinOptions(abort_grace=600.0), security=security
    )
    client.start()
    try:
        with pytest.raises(CoordinatorUnreachable) as caught:
            rendezvous(client, HELLO, endpoint, CONNECT_DEADLINE, store_timeout=5.0)
    finally:
        client.close(flush=0.1)
    return str(caught.value)


def test_a_silent_coordinator_is_said_to_not_answer_without_blaming_curve(silent: str):
    line = unreachable_line(silent, None)
    assert "\n" not in line
    assert line.startswith(f"the coordinator at {silent} does not answer: "), line
    assert "did not complete the ZeroMQ handshake for" in line, line
    seconds = re.search(r"handshake for (\d+) s", line)
    assert seconds is not None and int(seconds[1]) >= int(CONNECT_DEADLINE) - 1, line
    assert "CURVE" not in line, line


def test_with_curve_on_the_silent_coordinator_gets_the_key_hint(silent: str):
    public, secret = zmq.curve_keypair()
    server_public, _ = zmq.curve_keypair()
    security = ClientSecurity(public=public, secret=secret, server_public=server_public)
    line = unreachable_line(silent, security)
    assert line.startswith(f"the coordinator at {silent} does not answer: "), line
    assert "did not complete the ZeroMQ handshake" in line, line
    assert f"this worker uses CURVE: check that {CURVE_SERVER_KEY_ENV} names" in line, line
    assert "requires CURVE" not in line, line


def test_nobody_listening_is_still_said_as_before(tmp_path):
    endpoint = f"ipc://{tmp_path}/nobody.sock"
    line = unreachable_line(endpoint, None)
    assert line.startswith(f"no coordinator answered at {endpoint} within"), line


# ----------------------------------------------------------------------------- the rules alone


def test_a_handshake_that_times_out_is_no_refusal_and_is_said_with_how_long():
    watch = Handshake("tcp://h:1", timeout=15.0, curve=False)
    assert watch.unanswered(100.0) is None  # no connection yet: nobody listens, as before
    watch.connected(100.0)
    assert watch.failed(115.0) is False  # ran out of time: nothing answered
    watch.connected(115.1)
    line = watch.unanswered(130.0)
    assert line == (
        "the coordinator at tcp://h:1 does not answer: its port accepted the connection, but the "
        "coordinator did not complete the ZeroMQ handshake for 30 s (it is stopped, overloaded or "
        "out of file descriptors, or the address is not an epochal coordinator's)"
    )
    watch.succeeded()
    assert watch.unanswered(131.0) is None


def test_connections_closed_during_the_handshake_are_said_as_such():
    watch = Handshake("tcp://h:1", timeout=15.0, curve=False)
    for t in (0.0, 1.0, 2.0):
        watch.connected(t)
        assert watch.failed(t + 0.01) is True
    line = watch.unanswered(3.0)
    assert line is not None and "accepted 3 connections and closed each" in line
    assert "CURVE" not in line


def test_without_keys_a_failure_without_detail_blames_no_curve():
    assert describe_handshake_failure(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 11, curve=False) is None


def test_a_mechanism_mismatch_says_which_side_has_keys():
    mismatch = zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
    without = describe_handshake_failure(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, mismatch, curve=False)
    assert without is not None and "requires CURVE and this worker has no keys" in without
    keyed = describe_handshake_failure(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, mismatch, curve=True)
    assert keyed is not None and "does not use CURVE but this worker has keys" in keyed
