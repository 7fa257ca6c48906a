"""How a worker joins a run: :class:`JoinOptions`, read once from arguments and environment.

Every option of :func:`epochal.join` (and of :func:`epochal.train`'s joining part) is a field of
:class:`JoinOptions`, with its default written once, here. :meth:`JoinOptions.from_env` applies
the precedence the README states: an explicit argument, then its ``EPOCHAL_*`` variable (see
:mod:`epochal.environment`), then what the launcher says (:mod:`epochal.worker.launchenv`), then
the default; each variable is parsed once, and a bad one is refused naming it. The checks of the
coordinator's address that need no connection live here too.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from epochal.addressfile import file_path, wait_for
from epochal.environment import (
    CONNECT_TIMEOUT_ENV,
    COORDINATOR_ENV,
    CURVE_KEY_ENV,
    CURVE_SERVER_KEY_ENV,
    JOB_ENV,
    REATTACH_TIMEOUT_ENV,
    TOKEN_ENV,
    WORKER_ID_ENV,
)
from epochal.errors import ConfigError
from epochal.log import WORKER
from epochal.protocol import DEFAULT_JOB, check_job_name
from epochal.worker import launchenv
from epochal.worker.dataplane import network
from epochal.worker.launchenv import Placement

if TYPE_CHECKING:
    import torch

UNPLACED = Placement(rank=None, local_rank=0, world_size=None, source="")
"""No rank asked for, the first device, the world size unchecked."""

_POSITIVE = ("collective_timeout", "connect_timeout", "heartbeat_interval", "abort_grace")


@dataclass(frozen=True, kw_only=True, slots=True)
class JoinOptions:
    """How this worker joins a run; build it with :meth:`from_env` to honour the environment."""

    coordinator: str | None = None
    # the coordinator's address, tcp://HOST:PORT, or file:PATH (wait for the address file)
    job: str = DEFAULT_JOB
    # the job to join; a coordinator of another job refuses the worker
    token: str = ""
    # shared secret the coordinator may require
    worker_id: str | None = None
    # unique id of this worker; None: HOST/PID/random
    placement: Placement = UNPLACED
    # the rank to ask for, the local rank (device) and the world size expected
    device: str | torch.device | None = None
    # None: cuda:LOCAL_RANK when CUDA is there, else the CPU
    connect_timeout: float = 120.0
    # seconds to reach the coordinator and be admitted (the address file's wait included)
    collective_timeout: float = 600.0
    # seconds each data-plane collective may take
    heartbeat_interval: float = 1.0
    # seconds between this worker's heartbeats
    heartbeat_timeout: float = 15.0
    # seconds of the coordinator's silence after which it is considered lost
    abort_grace: float = 2.0
    # seconds the training code has to return to epochal after an abort before the process exits
    reattach_timeout: float = 60.0
    # seconds a worker whose coordinator vanished waits for a restarted one; 0: never
    curve_key: str | os.PathLike[str] | None = None
    # this worker's CURVE secret key file
    curve_server_key: str | os.PathLike[str] | None = None
    # the coordinator's CURVE public key file

    def __post_init__(self) -> None:
        try:
            check_job_name(self.job)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if not self.reattach_timeout >= 0:
            raise ConfigError(
                f"reattach_timeout must be >= 0 seconds (0: never), got {self.reattach_timeout}"
            )
        for name in _POSITIVE:
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {value}")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ConfigError("heartbeat_timeout must exceed heartbeat_interval")

    @property
    def reattach(self) -> bool:
        """Whether a restarted coordinator may take this worker back."""
        return self.reattach_timeout > 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **given: Any) -> JoinOptions:
        """The options ``given`` (those of :func:`epochal.join`), the rest from ``environ``.

        ``given`` takes every field but ``placement``, plus ``rank`` (a hint) and ``world_size``
        (expected); one left out or None comes from its variable, then from the default.
        """
        env = os.environ if environ is None else environ
        unknown = sorted(set(given) - _GIVEN)
        if unknown:
            raise TypeError(f"join() got an unexpected keyword argument {unknown[0]!r}")
        given = {k: v for k, v in given.items() if v is not None}
        coordinator = coordinator_address(given.pop("coordinator", None), env)
        if "connect_timeout" not in given:
            given["connect_timeout"] = env_seconds(env, CONNECT_TIMEOUT_ENV, 120.0)
        given["job"] = given.get("job") or env.get(JOB_ENV) or DEFAULT_JOB
        given.setdefault("token", env.get(TOKEN_ENV, ""))
        given["worker_id"] = given.get("worker_id") or env.get(WORKER_ID_ENV) or default_worker_id()
        given["placement"] = launchenv.placement(
            env, rank=given.pop("rank", None), world_size=given.pop("world_size", None)
        )
        if "reattach_timeout" not in given:
            given["reattach_timeout"] = env_seconds(
                env, REATTACH_TIMEOUT_ENV, 60.0, allow_zero=True
            )
        given.setdefault("curve_key", env.get(CURVE_KEY_ENV) or None)
        given.setdefault("curve_server_key", env.get(CURVE_SERVER_KEY_ENV) or None)
        return cls(coordinator=coordinator, **given)


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


def env_seconds(
    env: Mapping[str, str], name: str, default: float, *, allow_zero: bool = False
) -> float:
    """Seconds from the variable ``name`` (``default`` when unset or empty); ConfigError naming it
    when it is not a positive number (or zero, with ``allow_zero``)."""
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds") from None
    if not (value >= 0 if allow_zero else value > 0):
        raise ConfigError(f"{name} must be a positive number of seconds, got {raw!r}")
    return value


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
