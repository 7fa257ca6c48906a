"""CURVE over real ZeroMQ sockets on loopback: who gets a message through to the ROUTER.

"Refused" means the ROUTER receives nothing within REFUSAL_WINDOW seconds while the client's own
monitor reports the failed handshake. The control tests show the harness can see an intruder: a
CURVE server without an authenticator admits an unknown key, which secure_server must prevent.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from epochal.errors import ConfigError
from epochal.security import (
    ClientSecurity,
    KeyDirectory,
    ServerSecurity,
    describe_handshake_failure,
    secure_client,
    secure_server,
)

if TYPE_CHECKING:
    from conftest import Net

pytestmark = pytest.mark.timeout(30)

REFUSAL_WINDOW = 1.0
"""Seconds a refused client is given to get a message through."""

EVENT_DEADLINE = 5.0

STOP_DEADLINE = 60.0
"""Seconds for the intruders' loop to end once told to (it checks at every pass, then closes its
sockets and its context): past it, a hang, never a measure of speed."""

HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
)


def server_security(keydir: KeyDirectory, **changes: Any) -> ServerSecurity:
    return ServerSecurity.from_paths(keydir.coordinator_secret, keydir.allowed, **changes)


def worker_security(keydir: KeyDirectory, name: str = "worker-0") -> ClientSecurity:
    return ClientSecurity.from_paths(keydir.worker_secrets[name], keydir.coordinator_public)


def stranger(keydir: KeyDirectory) -> ClientSecurity:
    """A well-formed worker key pair that is not on the allow-list."""
    public, secret = zmq.curve_keypair()
    return ClientSecurity(
        public=public, secret=secret, server_public=worker_security(keydir).server_public
    )


def secured_router(net: Net, security: ServerSecurity) -> tuple[zmq.asyncio.Socket, str]:
    router = net.socket(zmq.ROUTER)
    net.keep(secure_server(net.ctx, router, security))
    router.bind("tcp://127.0.0.1:0")
    return router, router.getsockopt_string(zmq.LAST_ENDPOINT)


def curve_router_without_auth(
    net: Net, security: ServerSecurity, *, enforce: bool
) -> tuple[zmq.asyncio.Socket, str]:
    """A CURVE server socket set up by hand, with no authenticator in its context."""
    router = net.socket(
        zmq.ROUTER,
        CURVE_SERVER=1,
        CURVE_SECRETKEY=security.secret,
        CURVE_PUBLICKEY=security.public,
        ZAP_DOMAIN=security.domain.encode(),
        ZAP_ENFORCE_DOMAIN=int(enforce),
    )
    router.bind("tcp://127.0.0.1:0")
    return router, router.getsockopt_string(zmq.LAST_ENDPOINT)


def dealer(
    net: Net, endpoint: str, security: ClientSecurity | None = None
) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
    """A DEALER (CURVE when ``security`` is given) and its monitor, connected, with ``ping``
    already queued: it reaches the router as soon as a handshake lets it through.

    Queued before the handshake because a refused DEALER is dropped for good by libzmq (no
    reconnect after a protocol or authentication error), and a send then would block forever.
    """
    sock = net.socket(zmq.DEALER)
    if security is not None:
        secure_client(sock, security)
    mon = net.monitor(sock)
    sock.connect(endpoint)
    sock.send(b"ping", zmq.NOBLOCK)
    return sock, mon


async def handshake(mon: zmq.asyncio.Socket, within: float = EVENT_DEADLINE) -> tuple[int, int]:
    """The first handshake outcome the monitor reports within ``within`` s: (event, value)."""
    deadline = time.monotonic() + within
    while (left := deadline - time.monotonic()) > 0:
        if not await mon.poll(int(left * 1000)):
            break
        event = parse_monitor_message(await mon.recv_multipart())
        if event["event"] in HANDSHAKE_EVENTS:
            return int(event["event"]), int(event["value"])
    pytest.fail(f"no handshake outcome within {within:g} s")


async def round_trip(router: zmq.asyncio.Socket, client: zmq.asyncio.Socket) -> list[zmq.Frame]:
    """The client's ping reaches the router, whose pong comes back; returns the ping's frames."""
    assert await router.poll(int(EVENT_DEADLINE * 1000)), "the admitted client got nothing through"
    frames = await router.recv_multipart(copy=False)
    assert frames[-1].bytes == b"ping"
    await router.send_multipart([frames[0].bytes, b"pong"])
    assert await client.poll(int(EVENT_DEADLINE * 1000)), "the router's answer never came back"
    assert await client.recv() == b"pong"
    return frames


async def gets_through(router: zmq.asyncio.Socket) -> bool:
    """Whether anything reaches the router within REFUSAL_WINDOW."""
    return bool(await router.poll(int(REFUSAL_WINDOW * 1000)))


# ---------------------------------------------------------------------- admitted


async def test_allowed_worker_round_trips(net: Net, keydir: KeyDirectory) -> None:
    router, endpoint = secured_router(net, server_security(keydir))
    for name in keydir.worker_secrets:
        security = worker_security(keydir, name)
        client, mon = dealer(net, endpoint, security)
        assert await handshake(mon) == (zmq.EVENT_HANDSHAKE_SUCCEEDED, 0)
        frames = await round_trip(router, client)
        # the authenticator names the sender by its key: a coordinator can tie identity to key
        assert frames[-1].get("User-Id") == security.public.decode()


async def test_server_socket_options(net: Net, keydir: KeyDirectory) -> None:
    security = server_security(keydir, domain="job-7")
    router, _ = secured_router(net, security)
    assert router.getsockopt(zmq.CURVE_SERVER) == 1
    assert router.getsockopt(zmq.ZAP_ENFORCE_DOMAIN) == 1
    assert router.getsockopt(zmq.ZAP_DOMAIN) == b"job-7"
    assert router.getsockopt(zmq.MECHANISM) == zmq.CURVE


async def test_handshakes_answered_while_the_event_loop_is_blocked(
    net: Net, keydir: KeyDirectory
) -> None:
    """The authenticator has its own thread: a busy coordinator loop does not stall joins."""
    _, endpoint = secured_router(net, server_security(keydir))
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        secure_client(sock, worker_security(keydir))
        mon = sock.get_monitor_socket()
        sock.connect(endpoint)
        deadline = time.monotonic() + EVENT_DEADLINE
        outcome = None
        # a blocking wait inside the coroutine: this loop runs nothing else meanwhile
        while outcome is None and time.monotonic() < deadline:
            if mon.poll(100):
                event = parse_monitor_message(mon.recv_multipart())
                if event["event"] in HANDSHAKE_EVENTS:
                    outcome = event["event"]
        assert outcome == zmq.EVENT_HANDSHAKE_SUCCEEDED
        mon.close(linger=0)
        sock.close(linger=0)
    finally:
        ctx.destroy(linger=0)


# ---------------------------------------------------------------------- refused


async def test_key_not_on_the_allow_list_is_refused(net: Net, keydir: KeyDirectory) -> None:
    router, endpoint = secured_router(net, server_security(keydir))
    _, mon = dealer(net, endpoint, stranger(keydir))
    event, value = await handshake(mon)
    assert (event, value) == (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400)
    assert "allow-list" in (describe_handshake_failure(event, value, curve=True) or "")
    assert not await gets_through(router)


async def test_client_without_curve_is_refused(net: Net, keydir: KeyDirectory) -> None:
    router, endpoint = secured_router(net, server_security(keydir))
    _, mon = dealer(net, endpoint, None)
    event, value = await handshake(mon)
    assert event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    assert value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
    described = describe_handshake_failure(event, value, curve=False) or ""
    assert "the coordinator requires CURVE and this worker has no keys" in described
    assert not await gets_through(router)


async def test_client_with_a_wrong_server_key_is_refused(net: Net, keydir: KeyDirectory) -> None:
    router, endpoint = secured_router(net, server_security(keydir))
    right = worker_security(keydir)
    impostor_server, _ = zmq.curve_keypair()
    wrong = ClientSecurity(public=right.public, secret=right.secret, server_public=impostor_server)
    _, mon = dealer(net, endpoint, wrong)
    event, value = await handshake(mon)
    assert event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    assert "coordinator.key" in (describe_handshake_failure(event, value, curve=True) or "")
    assert not await gets_through(router)


async def test_allow_list_holds_only_in_its_domain(net: Net, keydir: KeyDirectory) -> None:
    """A second CURVE socket in the same context, in another ZAP domain, admits nobody."""
    security = server_security(keydir)
    secured_router(net, security)  # starts the context's authenticator, for domain "epochal"
    other = net.socket(
        zmq.ROUTER,
        CURVE_SERVER=1,
        CURVE_SECRETKEY=security.secret,
        CURVE_PUBLICKEY=security.public,
        ZAP_DOMAIN=b"another-job",
        ZAP_ENFORCE_DOMAIN=1,
    )
    other.bind("tcp://127.0.0.1:0")
    _, mon = dealer(net, other.getsockopt_string(zmq.LAST_ENDPOINT), worker_security(keydir))
    assert await handshake(mon) == (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400)
    assert not await gets_through(other)


# ---------------------------------------------------------------------- no authenticator


async def test_control_without_authenticator_libzmq_admits_anyone(
    net: Net, keydir: KeyDirectory
) -> None:
    """What secure_server guards against: with no ZAP handler and the domain not enforced,
    libzmq lets an unknown key in. If this stopped passing, the refusal tests would prove
    nothing."""
    router, endpoint = curve_router_without_auth(net, server_security(keydir), enforce=False)
    _, mon = dealer(net, endpoint, stranger(keydir))
    assert await handshake(mon) == (zmq.EVENT_HANDSHAKE_SUCCEEDED, 0)
    assert await gets_through(router)


async def test_enforced_domain_refuses_when_no_authenticator_answers(
    net: Net, keydir: KeyDirectory
) -> None:
    router, endpoint = curve_router_without_auth(net, server_security(keydir), enforce=True)
    _, mon = dealer(net, endpoint, stranger(keydir))
    event, _ = await handshake(mon)
    assert event != zmq.EVENT_HANDSHAKE_SUCCEEDED
    assert not await gets_through(router)


STOPPED_HANDSHAKE_IVL_MS = 1000
"""The router's handshake interval in the stopped-handler test (libzmq's default is 30 s)."""


async def test_stopped_authenticator_admits_nobody(net: Net, keydir: KeyDirectory) -> None:
    """If the handler goes away while the socket is bound, even allowed keys are refused.

    The handler's socket closes asynchronously: a handshake whose request reaches it while it
    closes is never answered, and the router drops that connection after its handshake interval;
    the client reconnects and its next handshake finds no handler and fails. So the outcome is
    due within the handshake interval plus the usual allowance.
    """
    router = net.socket(zmq.ROUTER)
    router.setsockopt(zmq.HANDSHAKE_IVL, STOPPED_HANDSHAKE_IVL_MS)
    auth = secure_server(net.ctx, router, server_security(keydir))
    router.bind("tcp://127.0.0.1:0")
    auth.stop()
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    for security in (worker_security(keydir), stranger(keydir)):
        _, mon = dealer(net, endpoint, security)
        event, _ = await handshake(mon, within=STOPPED_HANDSHAKE_IVL_MS / 1000 + EVENT_DEADLINE)
        assert event != zmq.EVENT_HANDSHAKE_SUCCEEDED
        assert not await gets_through(router)


def _intrude(endpoint: str, security: ClientSecurity, stop: threading.Event) -> None:
    """Open CURVE clients in a tight loop, each sending a message, until told to stop."""
    ctx = zmq.Context()
    sockets: list[zmq.Socket[Any]] = []
    try:
        while not stop.is_set():
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL, 1)
            secure_client(sock, security)
            sock.connect(endpoint)
            sock.send(b"intruder", zmq.NOBLOCK)
            sockets.append(sock)
            if len(sockets) > 64:
                sockets.pop(0).close(linger=0)
            time.sleep(0.001)
    finally:
        for sock in sockets:
            sock.close(linger=0)
        ctx.term()


@pytest.mark.parametrize("secured", [True, False], ids=["secure_server", "control-no-auth"])
async def test_clients_racing_the_bind_never_get_in(
    net: Net, keydir: KeyDirectory, tmp_path: Path, secured: bool
) -> None:
    """Unknown clients connect in a tight loop before and while the server is set up and binds.

    An ipc endpoint can be connected to before anything binds it (a tcp port 0 cannot be
    known in advance). With secure_server nothing gets through; the control run, a CURVE
    server with no authenticator, shows that the intruders do get in when the guard is missing.
    """
    endpoint = f"ipc://{tmp_path / 'coordinator.sock'}"
    security = server_security(keydir)
    stop = threading.Event()
    intruder = threading.Thread(target=_intrude, args=(endpoint, stranger(keydir), stop))
    intruder.start()
    try:
        await asyncio.sleep(0.05)  # intruders are already knocking
        if secured:
            router = net.socket(zmq.ROUTER)
            net.keep(secure_server(net.ctx, router, security))
            router.bind(endpoint)
        else:
            router = net.socket(
                zmq.ROUTER,
                CURVE_SERVER=1,
                CURVE_SECRETKEY=security.secret,
                CURVE_PUBLICKEY=security.public,
                ZAP_DOMAIN=security.domain.encode(),
            )
            router.bind(endpoint)
        got_in = bool(await router.poll(int(REFUSAL_WINDOW * 1000)))
    finally:
        stop.set()
        intruder.join(STOP_DEADLINE)
    assert not intruder.is_alive()
    assert got_in is not secured


# ---------------------------------------------------------------------- misuse


async def test_a_bound_socket_is_not_secured_after_the_fact(net: Net, keydir: KeyDirectory) -> None:
    router = net.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:0")
    with pytest.raises(ConfigError, match="already bound or connected"):
        secure_server(net.ctx, router, server_security(keydir))
    client = net.socket(zmq.DEALER)
    client.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))
    with pytest.raises(ConfigError, match="already bound or connected"):
        secure_client(client, worker_security(keydir))


async def test_one_authenticator_per_context(net: Net, keydir: KeyDirectory) -> None:
    secured_router(net, server_security(keydir))
    second = net.socket(zmq.ROUTER)
    with pytest.raises(ConfigError, match="one per context"):
        secure_server(net.ctx, second, server_security(keydir))
    # the failed attempt left no socket open: the fixture's context still terminates


async def test_restart_in_the_same_context(net: Net, keydir: KeyDirectory) -> None:
    """A coordinator restarted in-process gets a working authenticator every time, although
    libzmq frees the old one's ZAP endpoint only a moment after stop()."""
    security = server_security(keydir)
    for _ in range(10):
        router = net.socket(zmq.ROUTER)
        auth = secure_server(net.ctx, router, security)
        router.bind("tcp://127.0.0.1:0")
        router.close(linger=0)
        auth.stop()
    router, endpoint = secured_router(net, security)
    client, mon = dealer(net, endpoint, worker_security(keydir))
    assert await handshake(mon) == (zmq.EVENT_HANDSHAKE_SUCCEEDED, 0)
    await round_trip(router, client)


def test_secure_server_needs_no_running_event_loop(keydir: KeyDirectory) -> None:
    ctx = zmq.Context()
    try:
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        auth = secure_server(ctx, router, server_security(keydir))
        assert auth.is_alive()
        router.close(linger=0)
        auth.stop()
        assert not auth.is_alive()
    finally:
        ctx.term()


def test_refused_keys_are_logged(
    caplog: pytest.LogCaptureFixture, keydir: KeyDirectory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from epochal.security.curvekeys import _AllowList

    # once epochal's own handler is installed (by any earlier part of this process), its records
    # stop at the "epochal" logger; let them reach caplog's handler on the root too
    monkeypatch.setattr(logging.getLogger("epochal"), "propagate", True)
    allow = _AllowList(server_security(keydir).allowed)
    outsider = stranger(keydir).public
    with caplog.at_level(logging.INFO, logger="epochal.security"):
        assert allow.callback("epochal", worker_security(keydir).public)
        assert not allow.callback("epochal", outsider)
    assert outsider.decode() in caplog.text


def test_other_monitor_events_are_not_described() -> None:
    for curve in (False, True):
        assert describe_handshake_failure(zmq.EVENT_CONNECTED, 0, curve=curve) is None
        assert describe_handshake_failure(zmq.EVENT_HANDSHAKE_SUCCEEDED, 0, curve=curve) is None
