"""CURVE on the control plane: secure the coordinator's ROUTER and a worker's DEALER.

The coordinator calls :func:`secure_server` on its ROUTER *before* binding it: that starts a ZAP
authenticator that admits exactly the allow-listed worker keys, makes the socket a CURVE server
and enforces its ZAP domain. A worker calls :func:`secure_client` on its DEALER before
connecting. Key files are read by :mod:`epochal.security.keys`.

Why each step matters (libzmq 4.3): a CURVE server socket asks the ZAP handler of its context
about every handshake; when *no* handler is bound it admits any client that knows the server's
public key, unless ``ZMQ_ZAP_ENFORCE_DOMAIN`` is set. So the authenticator runs before the bind,
stops only after the socket is closed, and the domain is enforced as a second lock: if the
handler is ever gone, handshakes fail instead of passing.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from epochal.environment import CURVE_KEY_ENV, CURVE_SERVER_KEY_ENV
from epochal.errors import ConfigError
from epochal.security.keys import (
    KEY_LENGTH,
    load_allowed,
    load_client_keys,
    load_coordinator_public,
    load_server_keys,
)

DEFAULT_DOMAIN = "epochal"
"""ZAP domain of the coordinator's socket; the allow-list applies to this domain only."""

_log = logging.getLogger("epochal.security")


def _check_key(value: object, what: str) -> bytes:
    if not isinstance(value, bytes) or len(value) != KEY_LENGTH:
        raise ConfigError(f"{what} must be a {KEY_LENGTH}-byte Z85 CURVE key")
    try:
        z85.decode(value)
    except (KeyError, ValueError):
        raise ConfigError(f"{what} is not Z85-encoded") from None
    return value


def _check_unused(socket: zmq.Socket[Any], role: str) -> None:
    if socket.getsockopt(zmq.LAST_ENDPOINT):
        raise ConfigError(
            f"the {role} socket is already bound or connected: secure it first, then "
            "bind/connect (a handshake before that would not be authenticated)"
        )


# ---------------------------------------------------------------------- coordinator side


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerSecurity:
    """The coordinator's CURVE identity and the worker keys it admits."""

    public: bytes
    # the coordinator's public key (Z85); workers hold it as EPOCHAL_CURVE_SERVER_KEY
    secret: bytes = field(repr=False)
    # the coordinator's secret key (Z85); never printed
    allowed: frozenset[bytes]
    # public keys (Z85) of the workers admitted; every other key is refused at the handshake
    domain: str = DEFAULT_DOMAIN
    # ZAP domain of the coordinator's socket; enforced, and the allow-list covers only it

    def __post_init__(self) -> None:
        _check_key(self.public, "the coordinator's public key")
        _check_key(self.secret, "the coordinator's secret key")
        if zmq.curve_public(self.secret) != self.public:
            raise ConfigError("the coordinator's public and secret keys are not one key pair")
        if not isinstance(self.allowed, frozenset) or not self.allowed:
            raise ConfigError(
                "the allow-list of worker keys is empty: the coordinator would refuse every "
                "worker; give it the public key of each worker"
            )
        for key in self.allowed:
            _check_key(key, "every allow-listed worker key")
        if not self.domain or len(self.domain.encode()) > 254:
            raise ConfigError(f"the ZAP domain must be 1-254 bytes, got {self.domain!r}")

    @classmethod
    def from_paths(
        cls,
        secret_file: str | os.PathLike[str],
        allowed_dir: str | os.PathLike[str],
        *,
        domain: str = DEFAULT_DOMAIN,
    ) -> Self:
        """Load the coordinator's secret key file and its allow-list directory.

        Raises ConfigError naming the file and the fix when anything fails to load.
        """
        public, secret = load_server_keys(secret_file)
        return cls(public=public, secret=secret, allowed=load_allowed(allowed_dir), domain=domain)


REFUSED_KEYS_LOGGED = 20
"""Refused CURVE handshakes logged per minute (each key at most once a minute); the rest are
counted and summed up in the next line that is logged."""


class RefusedHandshakes:
    """Counts the CURVE handshakes the allow-list refused, and says which ones to log.

    A worker with a key that is not on the list retries its handshake every second or two, and a
    stranger may try many keys: each key is logged at most once a minute and at most
    :data:`REFUSED_KEYS_LOGGED` lines a minute in all, with the count of the rest. :meth:`refused`
    takes the clock as an argument and returns the line, so the rule is tested without sockets.
    """

    def __init__(self) -> None:
        self.total = 0
        # handshakes refused since the coordinator started
        self._window = float("-inf")
        self._shown: set[bytes] = set()
        # keys logged in this window
        self._hidden = 0
        # refusals in this window not logged

    def refused(self, key: bytes, now: float) -> str | None:
        """Record one refused handshake by ``key`` (Z85) at ``now``; the line to log, or None."""
        self.total += 1
        summary = ""
        if now - self._window >= 60.0:
            if self._hidden:
                summary = f" ({self._hidden} more refused handshakes in the minute before)"
            self._window, self._shown, self._hidden = now, set(), 0
        if key in self._shown or len(self._shown) >= REFUSED_KEYS_LOGGED:
            self._hidden += 1
            return None
        self._shown.add(key)
        return (
            f"refused a CURVE handshake: worker key {key.decode(errors='replace')} is not on the "
            "allow-list (if it is one of your workers, put its NAME.key into the --curve-allowed "
            f"directory and restart the coordinator){summary}"
        )

    def reporter(
        self, loop: asyncio.AbstractEventLoop, log: Callable[[str], None]
    ) -> Callable[[bytes], None]:
        """An ``on_refused`` for :func:`secure_server` that counts and logs on ``loop``'s thread.

        The authenticator calls it on its own thread; the count and the log line are left to
        the loop that owns them.
        """

        def note(key: bytes) -> None:
            line = self.refused(key, time.monotonic())
            if line is not None:
                log(line)

        def on_refused(key: bytes) -> None:
            try:
                loop.call_soon_threadsafe(note, key)
            except RuntimeError:  # the loop has closed: the coordinator is going away
                pass

        return on_refused

    def rendezvous_note(self) -> str:
        """What a rendezvous timeout adds when handshakes were refused: a likely cause."""
        if not self.total:
            return ""
        return (
            f"; {self.total} CURVE handshakes were refused meanwhile (logged above): a missing "
            "worker may hold a key that is not on the allow-list (--curve-allowed)"
        )


class _AllowList:
    """The credentials provider pyzmq's authenticator asks about each CURVE client key.

    It runs on the authenticator's thread; it reads a frozenset and hands refusals to
    ``on_refused`` (which must be safe to call from that thread).
    """

    def __init__(
        self, allowed: frozenset[bytes], on_refused: Callable[[bytes], None] | None = None
    ) -> None:
        self.allowed = allowed
        self.on_refused = on_refused

    def callback(self, domain: str, key: bytes) -> bool:
        admitted = key in self.allowed
        if not admitted:
            _log.info("refused a CURVE client key not on the allow-list: %s", key.decode())
            if self.on_refused is not None:
                self.on_refused(key)
        return admitted


ZAP_REBIND_TIMEOUT = 1.0
"""Seconds secure_server retries binding the context's ZAP endpoint while it is still taken.

libzmq releases an inproc endpoint asynchronously: for a millisecond or so after an
authenticator stops, the next one in the same context cannot bind. Past this, the endpoint is
held by a live authenticator and secure_server gives up.
"""


class _Authenticator(ThreadAuthenticator):
    """pyzmq's ThreadAuthenticator with a control-pipe endpoint that is never reused.

    pyzmq names the pipe after ``id(self)``; a new authenticator that inherits the id of one
    stopped a moment ago cannot bind it (see ZAP_REBIND_TIMEOUT).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipe_endpoint = f"inproc://epochal-zap-pipe-{uuid.uuid4().hex}"

    def discard(self) -> None:
        """Undo a start() that failed: stop() would block sending TERMINATE to no thread."""
        if self.pipe is not None:
            self.pipe.close(linger=0)
            self.pipe = None  # type: ignore[assignment]  # as pyzmq's own stop() does
        if self.zap_socket is not None:
            self.zap_socket.close(linger=0)
            self.zap_socket = None  # type: ignore[assignment]


def _start(auth: _Authenticator) -> None:
    deadline = time.monotonic() + ZAP_REBIND_TIMEOUT
    while True:
        try:
            auth.start()
            return
        except zmq.ZMQError as exc:
            auth.discard()
            if exc.errno != errno.EADDRINUSE:
                raise
            if time.monotonic() >= deadline:
                raise ConfigError(
                    "another ZAP authenticator already runs in this ZeroMQ context (libzmq "
                    "allows one per context): give the coordinator a zmq.asyncio.Context of "
                    "its own"
                ) from None
            time.sleep(0.005)


def secure_server(
    context: zmq.Context[Any],
    socket: zmq.Socket[Any],
    security: ServerSecurity,
    *,
    on_refused: Callable[[bytes], None] | None = None,
) -> ThreadAuthenticator:
    """Start the ZAP authenticator and make ``socket`` a CURVE server; call before ``bind``.

    ``on_refused(key)`` is called, on the authenticator's thread, with the Z85 public key of
    each handshake the allow-list refuses.

    Returns the running authenticator (a ``zmq.auth.thread.ThreadAuthenticator``). The caller
    owns it: ``stop()`` it after closing ``socket`` and before terminating ``context``.

    Raises ConfigError if the socket is already bound or connected, if this libzmq has no CURVE,
    or if the context already has a ZAP authenticator (libzmq allows one per context: give the
    coordinator a context of its own).
    """
    # ThreadAuthenticator rather than zmq.auth.asyncio.AsyncioAuthenticator (which DESIGN.md
    # names), although the coordinator is asyncio and uses a zmq.asyncio context:
    # - its handler has its own thread and loop, so handshakes are answered even while the
    #   coordinator's loop is busy (a journal fsync, a long decision) or between loops;
    #   AsyncioAuthenticator answers only when the caller's loop runs, and if that loop ends
    #   (e.g. start() and run() under two asyncio.run calls) every handshake hangs, unexplained;
    # - start() is synchronous and returns once the handler is polling, with no running loop
    #   required (AsyncioAuthenticator.start() raises outside a loop and leaks its ZAP socket);
    # - stop() is complete when it returns (thread joined, ZAP socket closed), where
    #   AsyncioAuthenticator.stop() closes the socket under a poll task it has only asked to
    #   cancel. Either way the ZAP socket is a plain zmq.Socket on the caller's context, which
    #   is what libzmq looks up per context, so the thread works with a zmq.asyncio.Context.
    if not zmq.has("curve"):
        raise ConfigError(
            "this libzmq was built without CURVE support: install a pyzmq wheel (which bundles "
            "a libzmq with CURVE) or a libzmq built with libsodium"
        )
    _check_unused(socket, "coordinator")
    auth = _Authenticator(context=context, log=logging.getLogger("epochal.security.zap"))
    # the policy is in place before the handler can receive its first request
    auth.configure_curve_callback(
        domain=security.domain, credentials_provider=_AllowList(security.allowed, on_refused)
    )
    _start(auth)
    try:
        socket.setsockopt(zmq.CURVE_SERVER, 1)
        socket.setsockopt(zmq.CURVE_SECRETKEY, security.secret)
        socket.setsockopt(zmq.CURVE_PUBLICKEY, security.public)
        socket.setsockopt(zmq.ZAP_DOMAIN, security.domain.encode())
        enforce = getattr(zmq, "ZAP_ENFORCE_DOMAIN", None)
        if enforce is not None:
            try:
                socket.setsockopt(enforce, 1)
            except zmq.ZMQError as exc:
                # A libzmq without the option (a draft before 4.3): the authenticator, running
                # from before bind until after close, is then the only lock. A handler that
                # dies leaves its socket bound and unanswered, so handshakes hang, not pass.
                if exc.errno != errno.EINVAL:
                    raise
                _log.warning("this libzmq cannot enforce the ZAP domain (ZAP_ENFORCE_DOMAIN)")
    except BaseException:
        auth.stop()
        raise
    return auth


# ---------------------------------------------------------------------- worker side


@dataclass(frozen=True, kw_only=True, slots=True)
class ClientSecurity:
    """A worker's CURVE key pair and the coordinator public key it trusts."""

    public: bytes
    # this worker's public key (Z85); it must be on the coordinator's allow-list
    secret: bytes = field(repr=False)
    # this worker's secret key (Z85); never printed
    server_public: bytes
    # the coordinator's public key (Z85): a coordinator without its secret key is not talked to

    def __post_init__(self) -> None:
        _check_key(self.public, "the worker's public key")
        _check_key(self.secret, "the worker's secret key")
        _check_key(self.server_public, "the coordinator's public key")
        if zmq.curve_public(self.secret) != self.public:
            raise ConfigError("the worker's public and secret keys are not one key pair")

    @classmethod
    def from_paths(
        cls, key_file: str | os.PathLike[str], server_key_file: str | os.PathLike[str]
    ) -> Self:
        """Load this worker's secret key file and the coordinator's public key file."""
        public, secret = load_client_keys(key_file)
        return cls(
            public=public, secret=secret, server_public=load_coordinator_public(server_key_file)
        )

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        key_file: str | os.PathLike[str] | None = None,
        server_key_file: str | os.PathLike[str] | None = None,
    ) -> Self | None:
        """The worker's CURVE settings from arguments, else :data:`CURVE_KEY_ENV` and
        :data:`CURVE_SERVER_KEY_ENV`; None when neither is given (CURVE off).

        An explicit argument wins over its variable. Only one of the two given is a ConfigError:
        a half-configured worker would fail its handshake with no useful message.
        """
        env = os.environ if environ is None else environ
        key = key_file if key_file is not None else env.get(CURVE_KEY_ENV) or None
        server = (
            server_key_file if server_key_file is not None else env.get(CURVE_SERVER_KEY_ENV)
        ) or None
        if key is None and server is None:
            return None
        if key is None:
            raise ConfigError(
                f"the coordinator's public key is given ({CURVE_SERVER_KEY_ENV}) but not this "
                f"worker's secret key: set {CURVE_KEY_ENV}=PATH/workers/NAME.key_secret too"
            )
        if server is None:
            raise ConfigError(
                f"this worker's secret key is given ({CURVE_KEY_ENV}) but not the coordinator's "
                f"public key: set {CURVE_SERVER_KEY_ENV}=PATH/coordinator.key too"
            )
        return cls.from_paths(Path(key), Path(server))


def secure_client(socket: zmq.Socket[Any], security: ClientSecurity) -> None:
    """Make ``socket`` a CURVE client of the coordinator; call before ``connect``."""
    if not zmq.has("curve"):
        raise ConfigError("this libzmq was built without CURVE support: install a pyzmq wheel")
    _check_unused(socket, "worker")
    socket.setsockopt(zmq.CURVE_PUBLICKEY, security.public)
    socket.setsockopt(zmq.CURVE_SECRETKEY, security.secret)
    socket.setsockopt(zmq.CURVE_SERVERKEY, security.server_public)


def describe_handshake_failure(event: int, value: int, *, curve: bool) -> str | None:
    """What a failed handshake with the coordinator means and what to do, for a worker that uses
    CURVE (``curve``) or not; None for events that are not handshake failures.

    Use with ``socket.get_monitor_socket()`` and ``zmq.utils.monitor.parse_monitor_message``:
    without it, a refused worker only sees a coordinator that never answers. CURVE is blamed only
    where it is in play: a refused key (only a CURVE coordinator refuses keys), a mechanism mismatch
    (one side has keys, the other not: which one is said), and a failure without detail on a worker
    that has keys. Without keys, a failure without detail is no refusal (None): the handshake timed
    out, or the peer closed the connection during it, so the coordinator does not answer
    (:class:`epochal.worker.control.waiting.Handshake` says so, with the address and how long).
    Under CURVE, pass it only for a connection the coordinator closed during the handshake: a CURVE
    coordinator closes the connection of a worker that holds another coordinator's key.
    """
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (
            f"the coordinator refused this worker's CURVE key (ZAP status {value}): add this "
            "worker's public key (its NAME.key) to the coordinator's allow-list directory and "
            f"restart the coordinator, or set {CURVE_KEY_ENV} to a key that is on the list"
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH and curve:
            return (
                "the coordinator does not use CURVE but this worker has keys: unset "
                f"{CURVE_KEY_ENV} and {CURVE_SERVER_KEY_ENV} for a coordinator without keys, or "
                "start the coordinator with --curve-key and --curve-allowed"
            )
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return (
                "the coordinator requires CURVE and this worker has no keys: set "
                f"{CURVE_KEY_ENV} (this worker's NAME.key_secret) and {CURVE_SERVER_KEY_ENV} (the "
                "coordinator.key) from the coordinator's key directory"
            )
        if curve:
            return f"the CURVE handshake with the coordinator failed (protocol error {value:#x})"
        return (
            f"the handshake with the coordinator failed (ZeroMQ protocol error {value:#x}): is the "
            "address an epochal coordinator's, of the same epochal version?"
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and curve:
        return (
            "the coordinator closed the connection during the CURVE handshake: most likely this "
            f"worker holds another coordinator's public key; {CURVE_SERVER_KEY_ENV} must name the "
            "coordinator.key from the same key directory as the coordinator's secret key"
        )
    return None
