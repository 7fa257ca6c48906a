"""The start of an epoch, kept in host memory, to redo the epoch in a world that lost ranks.

:meth:`Snapshot.take` copies to the CPU everything a checkpoint of the strategy holds
(``Strategy.state``: the model, the optimizer as the mode holds it, and with fp16 the loss scaler)
and every random-number generator (:func:`~epochal.worker.checkpoints.checkpoint.rng_state`);
:meth:`Snapshot.restore` loads that copy into a strategy of the same mode, possibly rebuilt over
another process group (:func:`~epochal.worker.regroup.leave.rebuild`), bit for bit. It goes
through the same Stateful a checkpoint goes through, so a world restored from memory and one
resumed from the checkpoint of the same epoch hold the same values.

What a copy can restore depends on the mode (``Strategy.snapshot_scope``): in ``replicated``
every rank's copy is whole; in ``main`` only rank 0's holds the optimizer, so a world whose rank 0
was lost loads the checkpoint; in ``sharded`` and ``fully_sharded`` each rank holds a shard, which a
lost rank takes with it, so :meth:`take` copies no state there at all (only the generators, which
each survivor keeps as its own) and the survivors load the last checkpoint, resharded by DCP.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from epochal.errors import EpochalError
from epochal.protocol import SnapshotScope
from epochal.worker.checkpoints.asyncsave import host_copy as copy_to_host
from epochal.worker.checkpoints.checkpoint import rng_state, set_rng_state
from epochal.worker.strategies.strategy import Mode, Strategy
from epochal.worker.training.initialization import is_dtensor


def _whole(tensor: torch.Tensor) -> None:
    if is_dtensor(tensor):
        raise EpochalError("a snapshot copies whole tensors: this state holds a DTensor shard")


def host_copy(value: Any) -> Any:
    """``value`` (nested dicts, lists and tuples of tensors and plain values) with every tensor
    copied to the CPU: a copy that training, which updates tensors in place, never touches. A
    snapshot holds whole tensors: a DTensor shard is refused."""
    return copy_to_host(value, _whole)


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (nested dicts, lists and tuples)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(v) for v in value)
    return 0


@dataclass(frozen=True, kw_only=True, slots=True)
class Snapshot:
    """One rank's copy of the start of an epoch: its strategy's state and its generators."""

    mode: Mode
    # the mode of the strategy it was taken from: it restores into that mode only
    rank: int
    # the rank that took it, in the world of its time (main: only rank 0's holds the optimizer)
    state: dict[str, Any] | None
    # a CPU copy of Strategy.state.state_dict(); None where the mode's state is sharded
    rng: dict[str, Any]
    # every generator, as the checkpoints keep them
    nbytes: int
    # bytes of the tensors in state: the host memory the snapshot takes
    seconds: float
    # how long take() took
    fresh_optimizer: bool = False
    # the optimizer had no state yet (the first epoch): a restore leaves it without any

    @classmethod
    def take(cls, strategy: Strategy) -> Snapshot:
        """Copy ``strategy``'s state and the generators, at the start of an epoch.

        In ``replicated`` with buffers (BatchNorm statistics) this is collective, as a checkpoint
        is: every rank first takes rank 0's buffers, which DDP would broadcast at the next forward.
        In ``sharded`` and ``fully_sharded`` only the generators are copied (no communication).
        """
        start = time.perf_counter()
        rng = rng_state()
        state = None
        optimizer = strategy.optimizer
        fresh = not optimizer.state
        if strategy.snapshot_scope is not SnapshotScope.SHARD:
            state = host_copy(strategy.state.state_dict())
            if fresh:
                # DCP read it by giving it a state first (one step at lr 0: an Adam step count
                # of 1); training on from that would not be the run without a snapshot
                optimizer.state.clear()
        return cls(
            mode=strategy.mode,
            rank=strategy.layout.rank,
            state=state,
            rng=rng,
            nbytes=0 if state is None else tensor_bytes(state),
            seconds=time.perf_counter() - start,
            fresh_optimizer=fresh,
        )

    def restore(self, strategy: Strategy) -> None:
        """Load this copy into ``strategy`` (the same mode, possibly rebuilt over another group)
        and set the generators to what they were. No communication; may be called again, the
        copy stays as taken. Refused, before anything changes, where the copy cannot restore the
        state: load the last checkpoint then (``Checkpointer.load(epoch, strategy.state,
        rng=False)``) and :meth:`restore_generators`."""
        if strategy.mode is not self.mode:
            raise EpochalError(
                f"a snapshot of mode {self.mode.value!r} cannot restore a strategy of mode "
                f"{strategy.mode.value!r}: rebuild the same mode (regroup.rebuild)"
            )
        if self.state is None:
            raise EpochalError(
                f"mode {self.mode.value!r} keeps a shard of its state on each rank, so a snapshot "
                "holds no state: load the last checkpoint (DCP reshards it to the new world) and "
                "restore the snapshot's generators alone (Snapshot.restore_generators)"
            )
        root = strategy.layout.is_root
        if strategy.snapshot_scope is SnapshotScope.ROOT and root and self.rank != 0:
            raise EpochalError(
                f"mode {self.mode.value!r} keeps the optimizer state on rank 0 alone, and this "
                f"snapshot was taken on rank {self.rank}: the old rank 0 was lost, so load "
                "the last checkpoint instead"
            )
        # a fresh copy: optimizers load tensors of their own device and dtype without copying
        strategy.state.load_state_dict(host_copy(self.state))
        if self.fresh_optimizer:  # as it was: no state (the hyperparameters are the copy's)
            strategy.optimizer.state.clear()
        self.restore_generators()

    def restore_generators(self) -> None:
        """Set every generator to what it was when the snapshot was taken."""
        set_rng_state(self.rng)
