"""Joining a run: :func:`join` says hello until admitted, opens the data-plane process group and
returns the worker's :class:`~epochal.worker.session.Session`.

It retries with backoff until the coordinator answers or the connect deadline passes (the
coordinator's own rendezvous timeout applies after that), checks what the launcher said against
what the coordinator decided (the world size), and from then on ends the process with one line,
no traceback, when the run stops.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from epochal.errors import (
    ConfigError,
    CoordinatorUnreachable,
    JoinRefused,
)
from epochal.log import ensure_configured
from epochal.nofile import raise_nofile_limit
from epochal.protocol import (
    Failed,
    Fingerprint,
    Hello,
    ParamSpec,
    Phase,
    Welcome,
    clip,
    understood,
)
from epochal.security.curvekeys import ClientSecurity
from epochal.worker import faults, launchenv
from epochal.worker.control.admission import StoreRef, rendezvous, tell_join_failure
from epochal.worker.control.client import ControlClient
from epochal.worker.control.exits import install as install_excepthook
from epochal.worker.dataplane import network
from epochal.worker.dataplane.sockets import GroupSockets
from epochal.worker.dataplane.store import scoped
from epochal.worker.fingerprint import describe
from epochal.worker.joinoptions import (
    JoinOptions,
    check_endpoint,
    coordinator_address,
    default_worker_id,
    read_address_file,
)
from epochal.worker.session import Session

T = TypeVar("T")


def _device_for(local_rank: int, device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def join(model: torch.nn.Module, options: JoinOptions | None = None, **given: Any) -> Session:
    """Join the run the coordinator holds and return this worker's Session.

    The keyword arguments are the fields of :class:`~epochal.worker.joinoptions.JoinOptions` (or
    pass
    ``options``, already built): ``coordinator``, ``job``, ``token``, ``worker_id``, ``rank``,
    ``world_size``, ``device``, ``connect_timeout``, ``collective_timeout``, ``abort_grace``,
    ``reattach_timeout``, ``curve_key``, ``curve_server_key``. Every argument left None comes from
    its environment variable (see :mod:`epochal.environment`), then from the default.
    ``connect_timeout`` (default 120 s) bounds the time to reach the coordinator and be admitted;
    after that the coordinator's own rendezvous timeout applies. ``collective_timeout`` bounds each
    data-plane collective. The heartbeats are the run's: the worker takes the coordinator's
    ``--heartbeat-interval`` and ``--heartbeat-timeout`` when it is admitted.
    ``reattach_timeout`` (default 60 s, 0: never) is how long a worker whose coordinator vanished
    waits for a restarted one to take it back; the run then resumes from its last checkpoint.
    ``curve_key`` (this worker's ``.key_secret`` file, else ``EPOCHAL_CURVE_KEY``) and
    ``curve_server_key`` (the coordinator's ``coordinator.key``, else
    ``EPOCHAL_CURVE_SERVER_KEY``) turn on CURVE for a coordinator that has keys.

    ``coordinator`` may be ``file:PATH``: the worker waits (within ``connect_timeout``) for the
    address file ``epochal coordinator --address-file PATH`` writes. ``rank`` (a hint),
    ``world_size`` (the size this worker expects; a coordinator with another is refused) and the
    local device default to ``EPOCHAL_RANK``/``EPOCHAL_WORLD_SIZE``/``EPOCHAL_LOCAL_RANK``, then to
    what torchrun, Slurm or a Kubernetes Indexed Job set (:mod:`epochal.worker.launchenv`).
    """
    if options is None:
        options = JoinOptions.from_env(**given)
    elif given:
        raise TypeError("join() takes options or keyword arguments, not both")
    dev = _device_for(options.placement.local_rank, options.device)
    described = describe(model)
    timeout = options.collective_timeout

    def open_group(admitted: Admission) -> GroupSockets:
        welcome, store = admitted.welcome, admitted.store
        if welcome.backend == "nccl" and dev.type != "cuda":
            raise ConfigError("the coordinator chose nccl but this worker has no CUDA device")
        faults.hit("connect", rank=welcome.rank)
        network.apply(admitted.plane, os.environ)  # gloo and NCCL read their interface at init
        _, sockets = GroupSockets.opened_by(
            lambda: dist.init_process_group(
                backend=welcome.backend,
                store=scoped(store.store, welcome.run_id, store.key),
                rank=welcome.rank,
                world_size=welcome.world_size,
                timeout=timedelta(seconds=timeout),
                device_id=dev if dev.type == "cuda" else None,
            )
        )
        admitted.client.at(Phase.SETUP, welcome.start_epoch)
        return sockets

    admitted, sockets = admit(
        options,
        described.fingerprint,
        cuda=dev.type == "cuda",
        params=described.params,  # sent, a page at a time, if the coordinator asks
        then=open_group,
    )
    return Session(
        admitted.client,
        admitted.welcome,
        dev,
        admitted.store,
        hello=admitted.hello,
        endpoint=admitted.endpoint,
        reattach_timeout=options.reattach_timeout,
        store_timeout=timeout,
        model=model,
        sockets=sockets,
    )


@dataclass(frozen=True, slots=True)
class Admission:
    """A worker the coordinator admitted: its control client, the hello it said, the welcome it
    got, the data-plane store and the network its data plane uses."""

    client: ControlClient
    hello: Hello
    endpoint: str
    welcome: Welcome
    store: StoreRef
    plane: network.DataPlane


def admit(
    options: JoinOptions,
    fingerprint: Fingerprint,
    *,
    cuda: bool,
    params: tuple[ParamSpec, ...] = (),
    then: Callable[[Admission], T],
) -> tuple[Admission, T]:
    """Join the run as ``options`` say, with a model of ``fingerprint`` (``params``: its entries,
    for a coordinator that asks), and run ``then`` on the admission (opening the process group,
    say). Whatever fails from the first hello to the end of ``then`` is told to the coordinator,
    so that the run ends at once, and the control client is closed; from here on an error that
    stops the run ends the process with one line, no traceback. Both :func:`join` and the member
    of a torchrun script (:mod:`epochal.worker.plain`) join this way."""
    ensure_configured()  # the worker's lines go to stderr even where nobody set logging up
    raise_nofile_limit()  # gloo connects to every peer (and rank 0 serves the store): one fd each
    address = coordinator_address(options.coordinator, os.environ)
    endpoint, deadline_s = read_address_file(address, options.connect_timeout)
    endpoint = check_endpoint(endpoint)
    where = options.placement
    plane = network.discover(endpoint)  # refuses an unusable network before joining
    security = ClientSecurity.from_env(
        {}, key_file=options.curve_key, server_key_file=options.curve_server_key
    )
    worker_id = options.worker_id or default_worker_id()
    client = ControlClient(
        endpoint, identity=worker_id.encode()[:255], options=options, security=security
    )
    install_excepthook(aborted=lambda: client._abort_reason)
    client.start()
    try:
        client.model_params = params
        hello = Hello(
            job=options.job,
            token=options.token,
            worker_id=worker_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            rank_hint=where.rank,
            device="cuda" if cuda else "cpu",
            fingerprint=fingerprint,
            data_address=plane.address,
            metrics=options.metrics,
            understands=understood(),
        )
        welcome, store = rendezvous(client, hello, endpoint, deadline_s, options.collective_timeout)
        mismatch = launchenv.check_world_size(where, welcome.world_size, elastic=welcome.elastic)
        if mismatch is not None:
            client.send(Failed(reason=clip(mismatch)))  # so the coordinator aborts at once
            raise JoinRefused(mismatch)
        admitted = Admission(client, hello, endpoint, welcome, store, plane)
        return admitted, then(admitted)
    except CoordinatorUnreachable:
        client.close(flush=0.5)
        raise
    except BaseException as exc:
        tell_join_failure(client, exc)
        client.close(flush=0.5)
        raise
