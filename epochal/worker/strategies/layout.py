"""Where and among whom a model trains: the device, the process group, this rank's place in it.

:func:`~epochal.worker.strategies.wrap` reads them from ``torch.distributed`` once
(:meth:`Layout.from_group`) and every mode is built from that one frozen :class:`Layout`
(:meth:`~epochal.worker.strategies.strategy.Strategy.build`, kept as ``Strategy.layout``). No mode
asks ``torch.distributed`` for a rank or a world size itself, nor keeps a copy of one: a strategy
built again for another process group, of another size, is a new layout and a new build, with
nothing left over from the old world. (torchtitan's ``ParallelDims`` plays the same part.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from epochal.errors import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """One rank's place in the data parallelism, built once per process group, read by each mode."""

    device: torch.device
    # where this rank computes: the model is moved there (a LayeredModel stays on the devices it
    # was placed on), DDP's device_ids and FSDP2's mesh name its type
    group: dist.ProcessGroup | None
    # the process group of the data parallelism; None: the default group (every rank)
    rank: int
    # this process's rank within group (0 .. world_size - 1)
    world_size: int
    # how many ranks group holds: gradients are averaged over them, state is sharded among them
    root: int
    # the global rank of group's rank 0 (torch's collectives name src and dst by global rank): it
    # gives every rank its initial parameters, and in mode main alone holds the optimizer
    placed: bool = False
    # the model is a LayeredModel spread over devices of its own (DDP then takes no device_ids)

    def __post_init__(self) -> None:
        if not isinstance(self.device, torch.device):
            raise ConfigError(f"a layout's device is a torch.device, got {self.device!r}")
        if type(self.world_size) is not int or self.world_size < 1:
            raise ConfigError(f"a world holds at least 1 rank, got world_size={self.world_size!r}")
        if type(self.rank) is not int or not 0 <= self.rank < self.world_size:
            raise ConfigError(
                f"rank {self.rank!r} is outside a world of {self.world_size} rank(s) (0 to "
                f"{self.world_size - 1}): build the layout from the process group this process "
                "belongs to (Layout.from_group)"
            )
        if type(self.root) is not int or self.root < 0:
            raise ConfigError(f"the root is a global rank >= 0, got {self.root!r}")
        if self.group is None and self.root != 0:
            raise ConfigError(
                f"the default group's rank 0 is global rank 0, got root={self.root}: name the "
                "group whose rank 0 that is"
            )

    @classmethod
    def from_group(
        cls, device: torch.device, group: dist.ProcessGroup | None = None, *, placed: bool = False
    ) -> Layout:
        """This process's layout in ``group`` (None: every rank), read from torch.distributed."""
        if not dist.is_initialized():
            raise ConfigError("wrap needs a process group: join the run first (epochal.join)")
        rank = dist.get_rank(group)
        if rank < 0:
            raise ConfigError(
                "this process is not a member of the process group it was given: pass a group "
                "made with this rank among its ranks (or none, for every rank)"
            )
        return cls(
            device=device,
            group=group,
            rank=rank,
            world_size=dist.get_world_size(group),
            root=0 if group is None else dist.get_global_rank(group, 0),
            placed=placed,
        )

    @property
    def is_root(self) -> bool:
        """Whether this process is the group's rank 0."""
        return self.rank == 0
