"""The worker's side of the rendezvous: say hello until admitted, then find the data-plane store.

:func:`rendezvous` is used by :func:`~epochal.worker.join.join` and again by a session that lost its
coordinator and says hello to a restarted (or merely stalled) one. Rank 0 opens the store the
process group meets at (:mod:`epochal.worker.dataplane.store`) and reports its address; the other
ranks learn it from their ``welcome``.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Any

from torch.distributed import TCPStore  # type: ignore[attr-defined]

from epochal.environment import CONNECT_TIMEOUT_ENV, COORDINATOR_ENV
from epochal.errors import CoordinatorUnreachable, EpochalError, JoinRefused, RunAborted
from epochal.log import WORKER
from epochal.protocol import (
    Failed,
    Hello,
    Joined,
    OpenStore,
    Phase,
    Reject,
    StoreReady,
    Welcome,
    clip,
)
from epochal.text import REASON_CHARS, printable
from epochal.worker.control.client import ControlClient
from epochal.worker.control.waiting import WaitNotices
from epochal.worker.dataplane.store import StoreServer, connect_store, new_key
from epochal.worker.joinoptions import advertised_host


class StillRunning(Exception):
    """During a re-attach, the lost coordinator sent what the worker was waiting for."""

    def __init__(self, message: Any) -> None:
        super().__init__(type(message).__name__)
        self.message = message


@dataclass(slots=True)
class StoreRef:
    """The data-plane store this worker uses, and the host it was reached at."""

    store: TCPStore
    host: str
    port: int
    key: str
    # the secret the process group's keys live under (see epochal.worker.dataplane.store)
    server: StoreServer | None = None
    # rank 0: the store's server process, which lives as long as this reference


def rendezvous(
    client: ControlClient,
    hello: Hello,
    endpoint: str,
    deadline_s: float,
    store_timeout: float,
    store: StoreRef | None = None,
    answers: tuple[type[Any], ...] = (),
) -> tuple[Welcome, StoreRef]:
    """Say hello until admitted, open (rank 0) or find the store, and return the Welcome.

    ``store`` is the store of a running process group (a re-attach): it is reused, not reopened.
    ``answers`` (a re-attach) are the messages the worker waited for when it lost the coordinator:
    only the coordinator that admitted it sends one, so one arriving raises :class:`StillRunning`.
    """
    started = time.monotonic()
    deadline = started + deadline_s
    notices = WaitNotices(endpoint, deadline_s, started, announced=store is not None)
    backoff = 0.1
    joined = False
    client.send(hello)
    while True:
        try:
            wait = min(backoff, max(deadline - time.monotonic(), 0.01))  # never past the deadline
            message = client.receive(timeout=None if joined else wait)
        except TimeoutError:
            now = time.monotonic()
            if now > deadline:
                unanswered = client.unanswered()  # a connection opened, its handshake never ended
                raise CoordinatorUnreachable(
                    f"{unanswered}; {CONNECT_TIMEOUT_ENV} sets how long a worker waits"
                    if unanswered is not None
                    else f"no coordinator answered at {endpoint} within {deadline_s:g} s: start "
                    f"it first (epochal coordinator --bind ...), or check the address "
                    f"({COORDINATOR_ENV}) and that no firewall blocks the port; "
                    f"{CONNECT_TIMEOUT_ENV} sets how long a worker waits"
                ) from None
            notice = notices.due(now)
            if notice is not None:
                WORKER.info(notice)
            backoff = min(backoff * 2, 2.0, max(0.1, deadline - now))
            client.send(hello)
            continue
        match message:
            case Joined():
                if not joined:
                    joined = True
                    client.watch_coordinator()
            case Reject(code="not_member"):
                pass  # the answer to a message queued before this hello: not about the hello
            case Reject(reason=reason):
                shown = printable(reason, REASON_CHARS)
                raise JoinRefused(f"the coordinator at {endpoint} refused this worker: {shown}")
            case OpenStore():
                if store is None:
                    client.at(Phase.CONNECT, 0)
                    host = advertised_host(endpoint)
                    server = StoreServer.start(host, store_timeout)
                    master = server.connect(store_timeout)
                    store = StoreRef(master, host, server.port, new_key(), server)
                client.send(StoreReady(host=store.host, port=store.port, key=store.key))
            case Welcome():
                if store is not None and store.server is not None:
                    store.server.expect(message.world_size)  # the cap grows with the world
                if store is None:
                    client.at(Phase.CONNECT, message.start_epoch)
                    found = connect_store(message.store_host, message.store_port, store_timeout)
                    store = StoreRef(
                        found, message.store_host, message.store_port, message.store_key
                    )
                return message, store
            case _ if isinstance(message, answers):
                raise StillRunning(message)
            case _:
                raise EpochalError(
                    f"unexpected {type(message).__name__} from the coordinator during rendezvous"
                )


def tell_join_failure(client: ControlClient, exc: BaseException) -> None:
    """Send the coordinator the error that ended this worker's join, naming the phase it hit.

    Without it, a worker whose data plane cannot connect (gloo's ``connectFullMesh failed``) is
    seen by the coordinator only as a silence. A refused or aborted worker is not told again.
    """
    if isinstance(exc, JoinRefused | RunAborted) or not isinstance(exc, Exception):
        return
    error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    client.send(Failed(reason=clip(f"{client.phase.description} failed: {error}")))
