"""A newcomer's state, received from its peers over the data plane, never read from disk.

When the world grows at an epoch boundary, the newcomer holds an untrained model and an optimizer
without state. :func:`share`, called by every rank of the new group once the strategies are built
(``wrap`` on the newcomer, :func:`~epochal.worker.regroup.leave.rebuild` on the others), gives
every rank rank ``src``'s model, optimizer and loss-scaler state:

- ``replicated`` and ``main``: ``src``'s own state, live, sent by broadcast (the structure as JSON,
  the tensors in buckets: :mod:`epochal.worker.regroup.wire`); in ``main`` the optimizer stays
  with rank 0, which must be ``src``.
- ``sharded`` and ``fully_sharded``: no rank holds the whole state, and the old group, where the
  shards were, is gone once the new one forms. So before leaving it the old members call
  :func:`consolidate`, which gathers the whole state onto rank 0's CPU (ZeRO's
  ``consolidate_state_dict``; DCP's full state dict for FSDP2), and rank 0 passes that to
  :func:`share` in the new group. ``sharded`` sends it whole and each rank keeps the optimizer
  state of the parameters it now owns; ``fully_sharded`` hands it to DCP's ``set_model_state_dict``
  and ``set_optimizer_state_dict`` with ``broadcast_from_rank0``, which sends one tensor at a
  time and keeps each rank's shard of it. (One ``set_state_dict`` call with an empty state on the
  other ranks skips the model there in torch 2.13, and rank 0 waits for them forever.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from epochal.errors import ConfigError
from epochal.worker.checkpoints.state import ShardedState
from epochal.worker.regroup.snapshot import host_copy, tensor_bytes
from epochal.worker.regroup.wire import broadcast_tree
from epochal.worker.strategies.base import Mode, SnapshotScope, Strategy
from epochal.worker.strategies.sharded import Sharded
from epochal.worker.training.precision import SCALER_KEY


@dataclass(frozen=True, kw_only=True, slots=True)
class FullState:
    """The whole state of a sharded mode, gathered onto one rank's CPU (:func:`consolidate`)."""

    mode: Mode
    # the mode it was gathered from
    state: dict[str, Any]
    # {"model": ..., "optim": ...} keyed by parameter name (DCP's format), and the loss scaler's
    # state under SCALER_KEY with fp16
    nbytes: int
    # bytes of its tensors


@dataclass(frozen=True, kw_only=True, slots=True)
class Transfer:
    """What one :func:`share` moved on this rank."""

    nbytes: int
    # bytes of the shared state (structure and tensors)
    seconds: float

    @property
    def rate(self) -> float:
        """Bytes per second."""
        return self.nbytes / self.seconds if self.seconds > 0 else float("inf")


def consolidate(strategy: Strategy) -> FullState | None:
    """In the OLD group, before leaving it: the whole state of a ``sharded`` or ``fully_sharded``
    strategy gathered onto rank 0, on the CPU, returned there (None on the other ranks).
    Collective. ``replicated`` and ``main`` need none (rank 0 holds the whole state): None."""
    if strategy.snapshot_scope is not SnapshotScope.SHARD:
        return None
    scaler = strategy.policy.scaler
    if isinstance(strategy, Sharded):
        full = _consolidate_zero(strategy)
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_sd, optim_sd = get_state_dict(
            strategy.model,
            strategy.optimizer,
            options=StateDictOptions(full_state_dict=True, cpu_offload=True),
        )
        full = {"model": model_sd, "optim": optim_sd} if strategy.layout.is_root else None
    if full is None:
        return None
    if scaler is not None:
        full[SCALER_KEY] = scaler.state_dict()
    return FullState(mode=strategy.mode, state=full, nbytes=tensor_bytes(full))


def _consolidate_zero(strategy: Sharded) -> dict[str, Any] | None:
    """ZeRO's whole optimizer state on rank 0, keyed by parameter name as ShardedState keys it."""
    zero = strategy.zero
    assert zero is not None
    zero.consolidate_state_dict(to=strategy.layout.root)
    if not strategy.layout.is_root:
        return None
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    gathered = zero.state_dict()  # keyed by index over zero.param_groups, already on the CPU
    names = ShardedState(strategy.model, zero).names
    order = [names[id(p)] for g in zero.param_groups for p in g["params"]]
    optim = {
        "state": {order[i]: s for i, s in gathered["state"].items()},
        "param_groups": [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [order[i] for i in g["params"]],
            }
            for g in gathered["param_groups"]
        ],
    }
    return {"model": host_copy(get_model_state_dict(strategy.model)), "optim": optim}


def _live_state(strategy: Strategy) -> dict[str, Any]:
    """``src``'s state in ``replicated`` and ``main``: the model, the optimizer where every rank
    holds one (replicated), the loss scaler. Tensors are the live ones; no communication."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    state: dict[str, Any] = {"model": get_model_state_dict(strategy.model)}
    if strategy.snapshot_scope is SnapshotScope.WHOLE:
        state["optim"] = get_optimizer_state_dict(strategy.model, strategy.optimizer)
    if strategy.policy.scaler is not None:
        state[SCALER_KEY] = strategy.policy.scaler.state_dict()
    return state


def _load_live(strategy: Strategy, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    set_model_state_dict(strategy.model, state["model"])
    if "optim" in state:
        set_optimizer_state_dict(strategy.model, strategy.optimizer, state["optim"])
    _load_scaler(strategy, state)


def _load_scaler(strategy: Strategy, state: dict[str, Any]) -> None:
    scaler = strategy.policy.scaler
    if scaler is not None and SCALER_KEY in state:
        scaler.load_state_dict(state[SCALER_KEY])


def share(strategy: Strategy, src: int = 0, full: FullState | None = None) -> Transfer:
    """Give every rank of the strategy's (new) group rank ``src``'s model, optimizer and
    loss-scaler state, over the data plane. Collective; every rank calls it after its strategy
    was built over the new group, a newcomer included.

    ``full``: in ``sharded`` and ``fully_sharded``, what :func:`consolidate` returned on ``src``
    in the old group (None on the other ranks); ``src`` must be 0 there (the rank that
    consolidated), and in ``main`` (the rank that holds the optimizer). A ``src`` with nothing to
    share makes every rank raise, none waits.
    """
    layout = strategy.layout
    if not 0 <= src < layout.world_size:
        raise ConfigError(f"src {src} is outside a world of {layout.world_size} rank(s)")
    scope = strategy.snapshot_scope
    if src != 0 and scope is not SnapshotScope.WHOLE:
        raise ConfigError(
            f"in mode {strategy.mode.value!r} rank 0 holds the state to share: share from src=0"
        )
    if full is not None and full.mode is not strategy.mode:
        raise ConfigError(
            f"a state consolidated in mode {full.mode.value!r} cannot be shared in mode "
            f"{strategy.mode.value!r}"
        )
    start = time.perf_counter()
    group, device = layout.group, layout.device
    root = src if group is None else dist.get_global_rank(group, src)
    sending = layout.rank == src
    if scope is not SnapshotScope.SHARD:
        state, nbytes = broadcast_tree(
            _live_state(strategy) if sending else None, src=root, group=group, device=device
        )
        if not sending:
            _load_live(strategy, state)
    elif isinstance(strategy, Sharded):
        state, nbytes = broadcast_tree(
            full.state if sending and full is not None else None,
            src=root,
            group=group,
            device=device,
        )
        if state is None:  # this rank is src and has nothing: the others raised
            raise ConfigError(_NOTHING)
        assert strategy.zero is not None
        ShardedState(strategy.model, strategy.zero).load_state_dict(state)
        _load_scaler(strategy, state)
    else:
        nbytes = _share_fully_sharded(strategy, full if sending else None, root)
    return Transfer(nbytes=nbytes, seconds=time.perf_counter() - start)


_NOTHING = (
    "rank 0 must pass share() the state consolidate() returned in the old group: in sharded "
    "modes no rank of the new group holds the whole state otherwise"
)


def _share_fully_sharded(strategy: Strategy, full: FullState | None, root: int) -> int:
    """FSDP2: the loss scaler and the size by our broadcast (which also tells the others when
    rank 0 has nothing), then DCP's broadcast from rank 0 into each rank's shards."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    layout = strategy.layout
    if root != 0:  # DCP broadcasts from global rank 0
        raise ConfigError(
            "mode 'fully_sharded' shares from global rank 0: share within the default group"
        )
    header = None
    if full is not None:
        header = {"nbytes": full.nbytes, "scaler": full.state.get(SCALER_KEY)}
    header, sent = broadcast_tree(header, src=root, group=layout.group, device=layout.device)
    if header is None:  # this rank is src and has nothing: the others raised
        raise ConfigError(_NOTHING)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    state: dict[str, Any] = full.state if full is not None else {}
    set_model_state_dict(strategy.model, state.get("model", {}), options=options)
    set_optimizer_state_dict(
        strategy.model, strategy.optimizer, state.get("optim", {}), options=options
    )
    if header["scaler"] is not None:
        _load_scaler(strategy, {SCALER_KEY: header["scaler"]})
    return sent + int(header["nbytes"])
