"""What the program that started this worker says about it: rank hint, local rank, world size.

A worker started by torchrun, by ``srun`` in a Slurm job or as a pod of a Kubernetes Indexed Job
finds its place in the run in that launcher's environment variables. Each launcher is a small
class behind :class:`LaunchEnvironment`, listed in :data:`LAUNCH_ENVIRONMENTS` in the order they
are tried (torchrun before Slurm, as Lightning does: torchrun is often started inside a Slurm job,
and then its variables are the ones that describe this process). Everything here is a pure
function of an environment mapping; :func:`join` applies the precedence: an explicit argument,
then an ``EPOCHAL_*`` variable, then the launcher, then the default. The coordinator still assigns
the ranks; what is read here is a hint, and an expected world size that is checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Protocol

from epochal.environment import LOCAL_RANK_ENV, RANK_ENV, WORLD_SIZE_ENV
from epochal.errors import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Where this worker stands in the run, as far as its launcher (or the user) says."""

    rank: int | None
    # the rank to ask the coordinator for; None: any
    local_rank: int
    # index on this machine: picks cuda:LOCAL_RANK
    world_size: int | None
    # the world size the launcher started; None: unknown, not checked
    source: str
    # who said so, for messages: "Slurm (SLURM_NTASKS=4)", "EPOCHAL_WORLD_SIZE=2", ...


def _int(env: Mapping[str, str], name: str, *, launcher: str, minimum: int = 0) -> int:
    raw = env.get(name, "")
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(
            f"{name}={raw!r} is not an integer: {launcher} sets it for each worker; unset it or "
            f"set {RANK_ENV}/{LOCAL_RANK_ENV}/{WORLD_SIZE_ENV} instead"
        ) from None
    if value < minimum:
        raise ConfigError(f"{name}={raw!r} must be >= {minimum} ({launcher})")
    return value


class LaunchEnvironment(Protocol):
    """One launcher: whether it started this process, and what it says about the process."""

    name: ClassVar[str]

    def detected(self, env: Mapping[str, str]) -> bool:
        """Whether ``env`` is the environment of a worker this launcher started."""
        ...

    def placement(self, env: Mapping[str, str]) -> Placement:
        """Rank, local rank and world size from ``env``; ConfigError when a value is invalid."""
        ...


def _checked(name: str, rank: int, local_rank: int, world: int | None, source: str) -> Placement:
    if world is not None and rank >= world:
        raise ConfigError(
            f"{name} says rank {rank} of a world of {world} ({source}): a rank must be below the "
            "world size; check the launcher's settings"
        )
    return Placement(rank=rank, local_rank=local_rank, world_size=world, source=source)


class Torchrun:
    """torchrun: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``TORCHELASTIC_RUN_ID`` are set."""

    name: ClassVar[str] = "torchrun"
    VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")

    def detected(self, env: Mapping[str, str]) -> bool:
        return all(v in env for v in self.VARIABLES)

    def placement(self, env: Mapping[str, str]) -> Placement:
        rank = _int(env, "RANK", launcher=self.name)
        local = _int(env, "LOCAL_RANK", launcher=self.name)
        world = _int(env, "WORLD_SIZE", launcher=self.name, minimum=1)
        return _checked(self.name, rank, local, world, f"torchrun (WORLD_SIZE={world})")


class Slurm:
    """A task of a Slurm job step (srun): ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS``."""

    name: ClassVar[str] = "Slurm"
    VARIABLES = ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS")

    def detected(self, env: Mapping[str, str]) -> bool:
        return all(v in env for v in self.VARIABLES)

    def placement(self, env: Mapping[str, str]) -> Placement:
        rank = _int(env, "SLURM_PROCID", launcher=self.name)
        local = _int(env, "SLURM_LOCALID", launcher=self.name)
        world = _int(env, "SLURM_NTASKS", launcher=self.name, minimum=1)
        return _checked(self.name, rank, local, world, f"Slurm (SLURM_NTASKS={world})")


class IndexedJob:
    """A pod of a Kubernetes Indexed Job: rank ``JOB_COMPLETION_INDEX``, one worker per pod.

    Kubernetes does not tell a pod how many completions its Job has, so the world size comes from
    ``EPOCHAL_WORLD_SIZE`` (set it in the pod template to the Job's ``completions``).
    """

    name: ClassVar[str] = "Kubernetes Indexed Job"
    VARIABLES = ("JOB_COMPLETION_INDEX",)

    def detected(self, env: Mapping[str, str]) -> bool:
        return all(v in env for v in self.VARIABLES)

    def placement(self, env: Mapping[str, str]) -> Placement:
        rank = _int(env, "JOB_COMPLETION_INDEX", launcher=self.name)
        return Placement(
            rank=rank, local_rank=0, world_size=None, source=f"{self.name} (JOB_COMPLETION_INDEX)"
        )


LAUNCH_ENVIRONMENTS: tuple[LaunchEnvironment, ...] = (Torchrun(), Slurm(), IndexedJob())
"""Every launcher recognised, in the order they are tried: the first detected one is used."""


def detect(env: Mapping[str, str]) -> LaunchEnvironment | None:
    """The launcher that started a process with environment ``env``; None when none did."""
    return next((launcher for launcher in LAUNCH_ENVIRONMENTS if launcher.detected(env)), None)


def _epochal_int(env: Mapping[str, str], name: str, minimum: int) -> int | None:
    raw = env.get(name, "")
    if raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {raw!r}")
    return value


def placement(
    env: Mapping[str, str], *, rank: int | None = None, world_size: int | None = None
) -> Placement:
    """This worker's placement: arguments, then ``EPOCHAL_*`` variables, then the launcher.

    ``rank`` and ``world_size`` are the caller's explicit arguments (None: not given).
    """
    launcher = detect(env)
    found = (
        launcher.placement(env)
        if launcher is not None
        else Placement(rank=None, local_rank=0, world_size=None, source="")
    )
    source = found.source
    env_rank = _epochal_int(env, RANK_ENV, 0)
    env_local = _epochal_int(env, LOCAL_RANK_ENV, 0)
    env_world = _epochal_int(env, WORLD_SIZE_ENV, 1)
    if world_size is not None:
        source = f"world_size={world_size}"
    elif env_world is not None:
        world_size, source = env_world, f"{WORLD_SIZE_ENV}={env_world}"
    else:
        world_size = found.world_size
    if rank is None:
        rank = env_rank if env_rank is not None else found.rank
    return Placement(
        rank=rank,
        local_rank=env_local if env_local is not None else found.local_rank,
        world_size=world_size,
        source=source,
    )


def check_world_size(
    expected: Placement, coordinator_world_size: int, *, elastic: bool = False
) -> str | None:
    """Why this worker must not run in a world of ``coordinator_world_size``; None if it may.
    In an ``elastic`` run the world may be smaller than the one started (ranks were lost)."""
    if expected.world_size is None or expected.world_size == coordinator_world_size:
        return None
    if elastic and coordinator_world_size < expected.world_size:
        return None
    return (
        f"this worker was started for a world of {expected.world_size} workers "
        f"({expected.source}) but the coordinator runs a world of {coordinator_world_size} "
        f"(its --world-size): start the coordinator with --world-size {expected.world_size}, or "
        f"launch {coordinator_world_size} workers"
    )
