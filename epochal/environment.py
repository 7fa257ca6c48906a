"""Names of the environment variables epochal reads, in one place.

An explicit argument always wins over the variable. The launcher (``epochal run``) sets these for
the workers it starts; a worker on another machine is pointed at its coordinator with
``EPOCHAL_COORDINATOR=tcp://HOST:PORT``.

Two more are the launcher's own, declared where they are used, in :mod:`epochal.zygote` (which
imports nothing of epochal): ``EPOCHAL_ZYGOTE``, a forked worker's channel to the process it was
forked from, and ``EPOCHAL_ZYGOTE_ROOM``, that process's room for its children's environments.
"""

from __future__ import annotations

from collections.abc import Mapping

from epochal.errors import ConfigError

COORDINATOR_ENV = "EPOCHAL_COORDINATOR"
"""Endpoint of the coordinator, e.g. ``tcp://10.0.0.5:29400``."""

JOB_ENV = "EPOCHAL_JOB"
"""Job name; must equal the coordinator's ``--job``."""

TOKEN_ENV = "EPOCHAL_TOKEN"
"""Shared secret the coordinator may require in every hello."""

CURVE_KEY_ENV = "EPOCHAL_CURVE_KEY"
"""A worker's CURVE secret key file (``workers/NAME.key_secret`` from ``epochal keys generate``)."""

CURVE_SERVER_KEY_ENV = "EPOCHAL_CURVE_SERVER_KEY"
"""The coordinator's CURVE public key file (``coordinator.key``), given to every worker."""

CHECKPOINT_KEY_FILE_ENV = "EPOCHAL_CHECKPOINT_KEY_FILE"
"""The key file that signs checkpoint manifests (64 hex digits, mode 0600), for the workers and the
coordinator alike; it must exist. Default: ``$XDG_CONFIG_HOME/epochal/checkpoint.key`` (else
``~/.config/epochal/checkpoint.key``), made on first use. Every process of a run must read the same
key: a shared home does that, else point this at a copy of one key on every machine."""

WORKER_ID_ENV = "EPOCHAL_WORKER_ID"
"""Unique id of this worker process (default: ``HOST/PID``)."""

RANK_ENV = "EPOCHAL_RANK"
"""Rank this worker asks for; the coordinator assigns any free rank when unset."""

LOCAL_RANK_ENV = "EPOCHAL_LOCAL_RANK"
"""Index of this worker on its machine: picks ``cuda:LOCAL_RANK`` on GPU machines."""

HOST_ENV = "EPOCHAL_HOST"
"""Address other workers reach this machine at (rank 0 advertises its data-plane store there)."""

IFNAME_ENV = "EPOCHAL_IFNAME"
"""Network interface of the data plane (default: the one that routes to the coordinator)."""

CONNECT_TIMEOUT_ENV = "EPOCHAL_CONNECT_TIMEOUT"
"""Seconds a worker keeps trying to reach its coordinator before giving up."""

COLLECTIVE_TIMEOUT_ENV = "EPOCHAL_COLLECTIVE_TIMEOUT"
"""Seconds each data-plane collective (an all-reduce, a broadcast) may take on a worker."""

DEFAULT_COLLECTIVE_TIMEOUT = 600.0
"""The default of :data:`COLLECTIVE_TIMEOUT_ENV` (``JoinOptions.collective_timeout``), declared
here because the coordinator's default ``--stall-abort`` is twice it
(:data:`epochal.coordinator.config.STALL_ABORT`)."""

ABORT_GRACE_ENV = "EPOCHAL_ABORT_GRACE"
"""Seconds a worker's training code has to come back to epochal after an abort (or a change of
the world) before the process ends itself."""

DEFAULT_ABORT_GRACE = 2.0
"""The default of :data:`ABORT_GRACE_ENV` (``JoinOptions.abort_grace``), declared here because the
launcher, which never imports the worker, bounds its workers' exit by it too."""

REATTACH_TIMEOUT_ENV = "EPOCHAL_REATTACH_TIMEOUT"
"""Seconds a worker whose coordinator vanished waits for a restarted one (0: stop at once)."""

DEFAULT_REATTACH_TIMEOUT = 60.0
"""The default of :data:`REATTACH_TIMEOUT_ENV` (``JoinOptions.reattach_timeout``)."""

PROGRESS_ENV = "EPOCHAL_PROGRESS"
"""``1`` forces the in-epoch progress bar on, ``0`` off; default: on when stderr is a terminal."""

WORLD_SIZE_ENV = "EPOCHAL_WORLD_SIZE"
"""World size this worker expects; one that differs from the coordinator's is refused. Default:
what the launcher says (torchrun's ``WORLD_SIZE``, Slurm's ``SLURM_NTASKS``), else unchecked."""

VERBOSE_ENV = "EPOCHAL_VERBOSE"
"""``1`` keeps a worker's full traceback for an error that stops the run (``RunAborted``,
``JoinRefused``, ...), which otherwise ends the worker with one line; ``epochal run --verbose``
and ``epochal worker --verbose`` set it for their workers."""

PRELOAD_ENV = "EPOCHAL_PRELOAD"
"""The modules ``epochal run`` imports once, in a process its workers are forked from
(comma-separated; default ``torch,torch.distributed,torch._dynamo,torch.distributed.checkpoint``);
``none`` starts each worker as a fresh interpreter that imports them itself (see
:mod:`epochal.launch.zygote`)."""

PRELOAD_SOCKET_ENV = "EPOCHAL_PRELOAD_SOCKET"
"""The Unix socket of a preloaded process shared by launches (``epochal preload SOCKET``): where
set, ``epochal run`` has that process fork its workers instead of starting one that imports
torch for this launch alone (one that cannot be used is said, and the launch starts its own); a
worker started by hand with it has rank 0's data-plane store server forked there."""

LOG_LEVEL_ENV = "EPOCHAL_LOG_LEVEL"
"""``debug``, ``info`` (the default), ``warning`` or ``error``: the least severe message epochal's
loggers write; ``--log-level`` of ``epochal run`` and ``epochal worker`` sets it for their
workers."""

LOG_FORMAT_ENV = "EPOCHAL_LOG_FORMAT"
"""``text`` (the default: the lines alone) or ``json`` (one object a line); ``--log-format`` of
``epochal run`` and ``epochal worker`` sets it for their workers."""


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
