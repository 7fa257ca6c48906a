"""How a worker joins a run: :class:`JoinOptions`, read once from arguments and environment.

Every option of :func:`epochal.join` (and of :func:`epochal.train`'s joining part) is a field of
:class:`JoinOptions`, with its default written once, here. :meth:`JoinOptions.from_env` applies
the precedence the guide states (docs/worker-api.md): an explicit argument, then its
``EPOCHAL_*`` variable (see :mod:`epochal.environment`), then what the launcher says
(:mod:`epochal.worker.launchenv`), then the default; each variable is parsed once, and a bad one
is refused naming it. The checks of the coordinator's address that need no connection live here
too.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from epochal.environment import (
    ABORT_GRACE_ENV,
    COLLECTIVE_TIMEOUT_ENV,
    CONNECT_TIMEOUT_ENV,
    COORDINATOR_ENV,
    CURVE_KEY_ENV,
    CURVE_SERVER_KEY_ENV,
    DEFAULT_ABORT_GRACE,
    DEFAULT_COLLECTIVE_TIMEOUT,
    DEFAULT_REATTACH_TIMEOUT,
    JOB_ENV,
    REATTACH_TIMEOUT_ENV,
    TOKEN_ENV,
    WORKER_ID_ENV,
    env_seconds,
)
from epochal.errors import ConfigError
from epochal.log import WORKER
from epochal.protocol import DEFAULT_JOB, check_job_name
from epochal.rundir.addressfile import file_path, wait_for
from epochal.worker import launchenv
from epochal.worker.dataplane import network
from epochal.worker.launchenv import Placement

if TYPE_CHECKING:
    import torch

UNPLACED = Placement(rank=None, local_rank=0, world_size=None, source="")
"""No rank asked for, the first device, the world size unchecked."""

VARIABLE = "epochal.variable"
"""The key of a field's environment variable in its metadata (see :func:`_from`)."""

Parse = Callable[[str, str], Any]
"""Turns a variable's text into the field's value, or raises ConfigError naming the variable."""


def _text(name: str, raw: str) -> str:
    return raw


def _seconds(name: str, raw: str) -> float:
    return env_seconds({name: raw}, name, 0.0)


def _seconds_or_never(name: str, raw: str) -> float:
    return env_seconds({name: raw}, name, 0.0, allow_zero=True)


def _from(variable: str, parse: Parse = _text) -> dict[str, tuple[str, Parse]]:
    """Field metadata: the field's ``EPOCHAL_*`` variable and how its text is read."""
    return {VARIABLE: (variable, parse)}


@dataclass(frozen=True, kw_only=True, slots=True)
class JoinOptions:
    """How this worker joins a run; build it with :meth:`from_env` to honour the environment.

    Each field's default and its variable are declared here, once; :meth:`from_env` reads them.
    The heartbeats are not among them: they are the run's (the coordinator's
    ``--heartbeat-interval`` and ``--heartbeat-timeout``), sent to every worker when it joins.
    """

    coordinator: str | None = None
    # the coordinator's address, tcp://HOST:PORT, or file:PATH (wait for the address file)
    job: str = field(default=DEFAULT_JOB, metadata=_from(JOB_ENV))
    # the job to join; a coordinator of another job refuses the worker
    token: str = field(default="", metadata=_from(TOKEN_ENV))
    # shared secret the coordinator may require
    worker_id: str | None = field(default=None, metadata=_from(WORKER_ID_ENV))
    # unique id of this worker; None: HOST/PID/random
    placement: Placement = UNPLACED
    # the rank to ask for, the local rank (device) and the world size expected
    device: str | torch.device | None = None
    # None: cuda:LOCAL_RANK when CUDA is there, else the CPU
    connect_timeout: float = field(default=120.0, metadata=_from(CONNECT_TIMEOUT_ENV, _seconds))
    # seconds to reach the coordinator and be admitted (the address file's wait included)
    collective_timeout: float = field(
        default=DEFAULT_COLLECTIVE_TIMEOUT, metadata=_from(COLLECTIVE_TIMEOUT_ENV, _seconds)
    )
    # seconds each data-plane collective may take
    abort_grace: float = field(
        default=DEFAULT_ABORT_GRACE, metadata=_from(ABORT_GRACE_ENV, _seconds)
    )
    # seconds the training code has to return to epochal after an abort before the process exits
    reattach_timeout: float = field(
        default=DEFAULT_REATTACH_TIMEOUT, metadata=_from(REATTACH_TIMEOUT_ENV, _seconds_or_never)
    )
    # seconds a worker whose coordinator vanished waits for a restarted one; 0: never
    curve_key: str | os.PathLike[str] | None = field(default=None, metadata=_from(CURVE_KEY_ENV))
    # this worker's CURVE secret key file
    curve_server_key: str | os.PathLike[str] | None = field(
        default=None, metadata=_from(CURVE_SERVER_KEY_ENV)
    )
    # the coordinator's CURVE public key file
    metrics: tuple[str, ...] | None = None
    # the names of the metrics the training code reports (epochal.train says them): the
    # coordinator stops a run whose --monitor names none of them before it trains; None: not said

    def __post_init__(self) -> None:
        try:
            check_job_name(self.job)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if not self.reattach_timeout >= 0:
            raise ConfigError(
                f"reattach_timeout must be >= 0 seconds (0: never), got {self.reattach_timeout}"
            )
        for name in ("collective_timeout", "connect_timeout", "abort_grace"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {value}")

    @property
    def reattach(self) -> bool:
        """Whether a restarted coordinator may take this worker back."""
        return self.reattach_timeout > 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **given: Any) -> JoinOptions:
        """The options ``given`` (those of :func:`epochal.join`), the rest from ``environ``.

        ``given`` takes every field but ``placement``, plus ``rank`` (a hint) and ``world_size``
        (expected); one left out or None comes from its variable (empty counts as unset), then
        from the default its field declares.
        """
        env = os.environ if environ is None else environ
        moved = sorted(set(given) & RUN_SETTINGS)
        if moved:
            raise TypeError(
                f"join() no longer takes {moved[0]!r}: the heartbeats are the run's, set on the "
                f"coordinator (--{moved[0].replace('_', '-')}) and sent to every worker"
            )
        unknown = sorted(set(given) - _GIVEN)
        if unknown:
            raise TypeError(f"join() got an unexpected keyword argument {unknown[0]!r}")
        given = {k: v for k, v in given.items() if v is not None}
        coordinator = coordinator_address(given.pop("coordinator", None), env)
        for spec in dataclasses.fields(cls):
            if spec.name in given or VARIABLE not in spec.metadata:
                continue
            variable, parse = spec.metadata[VARIABLE]
            raw = env.get(variable)
            if raw:
                given[spec.name] = parse(variable, raw)
        given["worker_id"] = given.get("worker_id") or default_worker_id()
        given["placement"] = launchenv.placement(
            env, rank=given.pop("rank", None), world_size=given.pop("world_size", None)
        )
        return cls(coordinator=coordinator, **given)


RUN_SETTINGS = frozenset({"heartbeat_interval", "heartbeat_timeout"})
"""Options a worker once took that are the run's now (the coordinator sends them)."""


_GIVEN = {f.name for f in dataclasses.fields(JoinOptions)} - {"placement"} | {"rank", "world_size"}
"""The keyword arguments of :meth:`JoinOptions.from_env` (and of :func:`epochal.join`)."""


def coordinator_address(given: str | None, env: Mapping[str, str]) -> str:
    """The coordinator's address: ``given``, else :data:`COORDINATOR_ENV`; ConfigError when
    neither says, naming both and ``epochal run``."""
    address = given or env.get(COORDINATOR_ENV)
    if not address:
        raise ConfigError(
            "no coordinator address: pass coordinator='tcp://HOST:PORT' or set "
            f"{COORDINATOR_ENV}, or start the script with `epochal run --nproc N SCRIPT`"
        )
    return address


def default_worker_id() -> str:
    """``HOST/PID/random``: unique among the workers of a run."""
    return f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:6]}"


def check_endpoint(endpoint: str) -> str:
    """``endpoint`` if it is a ZeroMQ endpoint a worker can connect to, else a ConfigError."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("tcp", "ipc", "inproc") or not (parts.netloc or parts.path):
        raise ConfigError(
            f"coordinator address {endpoint!r} is not a ZeroMQ endpoint: use tcp://HOST:PORT "
            f"(pass coordinator=... or set {COORDINATOR_ENV})"
        )
    if parts.scheme == "tcp" and (parts.port is None or parts.port == 0):
        raise ConfigError(
            f"coordinator address {endpoint!r} has no port: use the address the coordinator "
            "printed when it started, e.g. tcp://127.0.0.1:29400"
        )
    return endpoint


def read_address_file(spec: str, deadline_s: float) -> tuple[str, float]:
    """Resolve ``file:PATH`` to the address in that file; return it and the time left."""
    path = file_path(spec)
    if path is None:
        return spec, deadline_s
    started = time.monotonic()
    endpoint = wait_for(path, deadline_s, say=lambda line: WORKER.info(f"epochal: {line}"))
    return endpoint, max(0.1, deadline_s - (time.monotonic() - started))


def advertised_host(endpoint: str) -> str:
    """The address of this machine that the coordinator's peers can reach.

    ``EPOCHAL_HOST`` wins, then ``EPOCHAL_IFNAME``'s address; a loopback coordinator means a
    single-machine run (127.0.0.1); otherwise the local address of the route to the coordinator
    (see :mod:`epochal.worker.dataplane.network`).
    """
    return network.discover(endpoint).address
