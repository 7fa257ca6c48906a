"""The options of the optimization modes, as one frozen dataclass.

Each mode class (:mod:`epochal.worker.strategies.strategy`) names the fields it has a use for;
:func:`epochal.worker.strategies.wrap` refuses the others. ``mode_options`` turns a user's mapping
into :class:`ModeOptions`, refusing unknown keys by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from torch import nn

from epochal.errors import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class ModeOptions:
    """Options of the optimization modes; an option a mode has no use for is refused."""

    bucket_cap_mb: float | None = None
    # gradient bucket size in MiB: DDP's (replicated, sharded) and main's reduce/broadcast buckets;
    # None: 25, DDP's default
    find_unused_parameters: bool = False
    # some parameters may get no gradient in a step (a branch not taken): DDP's option of that
    # name (replicated, sharded); in main, a parameter no rank has a gradient for is left
    # without one, so the optimizer skips it
    sync_batchnorm: bool = False
    # turn every BatchNorm into SyncBatchNorm, batch statistics over all ranks (replicated, main,
    # sharded); torch's SyncBatchNorm trains on CUDA devices only
    reshard_after_forward: bool = True
    # fully_sharded: free the gathered parameters after forward and gather them again in backward
    shard_units: Callable[[nn.Module], Iterable[nn.Module]] | None = None
    # fully_sharded: the submodules fully_shard wraps one by one (each its own all-gather), before
    # the root; None: every child with parameters, looking inside ModuleList and ModuleDict

    def __post_init__(self) -> None:
        if self.bucket_cap_mb is not None and not self.bucket_cap_mb > 0:
            raise ConfigError(f"bucket_cap_mb must be > 0 MiB, got {self.bucket_cap_mb}")


def option_names() -> list[str]:
    """The fields of :class:`ModeOptions`, in declaration order."""
    return [f.name for f in fields(ModeOptions)]


def mode_options(options: ModeOptions | Mapping[str, Any] | None) -> ModeOptions:
    """``options`` as a :class:`ModeOptions`; a mapping's unknown keys are refused by name."""
    if options is None:
        return ModeOptions()
    if isinstance(options, ModeOptions):
        return options
    known = option_names()
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ConfigError(
            f"unknown mode option(s) {', '.join(unknown)}: the options are {', '.join(known)} "
            "(DDP's other keyword arguments go in ddp_options)"
        )
    return ModeOptions(**options)
