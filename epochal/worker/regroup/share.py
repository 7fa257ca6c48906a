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
  :func:`consolidate`, which gathers the whole state onto rank 0's CPU (each ZeRO shard in turn
  over the same wire; DCP's full state dict for FSDP2), and rank 0 passes that to :func:`share`
  in the new group. It travels a chunk at a time, and each rank keeps only its part as it
  arrives: in ``sharded`` the model and the optimizer state of the parameters it now owns, in
  ``fully_sharded`` its shard of each tensor, which DCP then loads as a sharded state.

Neither ZeRO's ``consolidate_state_dict`` nor DCP's ``broadcast_from_rank0`` is used: both
unpickle what a peer sent (torch 2.13), and a newcomer's state must not depend on trusting
pickles.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from epochal.errors import ConfigError
from epochal.protocol import SnapshotScope
from epochal.worker.checkpoints.state import ShardedState
from epochal.worker.regroup.snapshot import host_copy, tensor_bytes
from epochal.worker.regroup.wire import Expects, broadcast_tree
from epochal.worker.strategies.sharded import Sharded
from epochal.worker.strategies.strategy import Mode, Strategy
from epochal.worker.training.initialization import is_dtensor
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
    Collective; nothing a peer sends is unpickled. ``replicated`` and ``main`` need none (rank 0
    holds the whole state): None."""
    if strategy.snapshot_scope is not SnapshotScope.SHARD:
        return None
    if strategy.released:
        raise ConfigError("consolidate() runs in the old group, before leave()")
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
    scaler = strategy.policy.scaler
    if scaler is not None:
        full[SCALER_KEY] = scaler.state_dict()
    return FullState(mode=strategy.mode, state=full, nbytes=tensor_bytes(full))


def _model_entries(strategy: Strategy) -> dict[str, torch.Tensor]:
    """This rank's model entries by every name a peer's state may give them: its state dict's
    (``module.``-prefixed under DDP, as a snapshot names them) and DCP's (as the optimizer state
    and ``share`` name them)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    entries = dict(strategy.model.state_dict())
    entries.update(get_model_state_dict(strategy.model))
    return {name: t for name, t in entries.items() if isinstance(t, torch.Tensor)}


def _expects_state(strategy: Strategy) -> Expects:
    """What a rank accepts of a state :func:`share` sends: this model's entries under
    ``model``, an optimizer state for its parameters under ``optim``, single values in the
    parameter groups and the loss scaler's state."""
    return Expects.of_model(
        _model_entries(strategy),
        entries=(("model",),),
        optim=(("optim", "state"),),
        scalars=(("optim", "param_groups"), (SCALER_KEY,)),
    )


def _to_host(path: tuple[Any, ...], tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def _nothing(path: tuple[Any, ...], tensor: torch.Tensor) -> None:
    return None


def _consolidate_zero(strategy: Sharded) -> dict[str, Any] | None:
    """ZeRO's whole optimizer state on rank 0, keyed by parameter name as ShardedState keys it:
    each rank in turn broadcasts its shard (:func:`broadcast_tree`), rank 0 keeps a host copy,
    the others drop what passes. (ZeRO's own ``consolidate_state_dict`` would unpickle every
    peer's shard.)"""
    zero = strategy.zero
    assert zero is not None
    layout = strategy.layout
    own = ShardedState(strategy.model, zero).state_dict()  # this rank's shard, by name
    expects = Expects.of_model(_model_entries(strategy), optim=((),))
    gathered: dict[str, Any] = {}
    for rank in range(layout.world_size):
        src = rank if layout.group is None else dist.get_global_rank(layout.group, rank)
        shard, _ = broadcast_tree(
            own["optim"]["state"] if layout.rank == rank else None,
            src=src,
            group=layout.group,
            device=layout.device,
            expects=expects,
            keep=_to_host if layout.is_root else _nothing,
        )
        if layout.is_root:
            gathered.update(shard)
    if not layout.is_root:
        return None
    groups = host_copy(own["optim"]["param_groups"])
    return {"model": host_copy(own["model"]), "optim": {"state": gathered, "param_groups": groups}}


def _live_state(strategy: Strategy) -> dict[str, Any]:
    """``src``'s state in ``replicated`` and ``main``: the model, the optimizer where every rank
    holds one (replicated) and it has state, the loss scaler. Tensors are the live ones; no
    communication. (An optimizer without state is not sent: reading it through DCP would give it
    a state, an Adam step count of 1, that the run it came from never had.)"""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    state: dict[str, Any] = {"model": get_model_state_dict(strategy.model)}
    if strategy.snapshot_scope is SnapshotScope.WHOLE and strategy.optimizer.state:
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
    loss-scaler state, over the data plane, unpickling nothing. Collective; every rank calls it
    after its strategy was built over the new group, a newcomer included.

    ``full``: in ``sharded`` and ``fully_sharded``, what :func:`consolidate` returned on ``src``
    in the old group (None on the other ranks); ``src`` must be 0 there (the rank that
    consolidated), and in ``main`` (the rank that holds the optimizer). Each rank keeps only its
    part as it arrives: its ZeRO shard of the optimizer state, its FSDP2 shards. A ``src`` with
    nothing to share makes every rank raise, none waits.
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
    expects = _expects_state(strategy)
    if scope is not SnapshotScope.SHARD:
        state, nbytes = broadcast_tree(
            _live_state(strategy) if sending else None,
            src=root,
            group=group,
            device=device,
            expects=expects,
        )
        if not sending:
            _load_live(strategy, state)
        return Transfer(nbytes=nbytes, seconds=time.perf_counter() - start)
    tree = full.state if sending and full is not None else None
    if isinstance(strategy, Sharded):
        assert strategy.zero is not None
        sharded = ShardedState(strategy.model, strategy.zero)
        owned = {
            sharded.names[id(p)] for g in strategy.zero.optim.param_groups for p in g["params"]
        }

        def keep(path: tuple[Any, ...], tensor: torch.Tensor) -> torch.Tensor | None:
            other = path[:2] == ("optim", "state") and path[2] not in owned
            return None if other else tensor  # another rank's shard of the optimizer state

        state, nbytes = broadcast_tree(
            tree, src=root, group=group, device=device, expects=expects, keep=keep
        )
        if state is None:  # this rank is src and has nothing: the others raised
            raise ConfigError(_NOTHING)
        sharded.load_state_dict(state)
    else:
        state, nbytes = _share_fully_sharded(strategy, tree, root, expects)
    _load_scaler(strategy, state)
    return Transfer(nbytes=nbytes, seconds=time.perf_counter() - start)


_NOTHING = (
    "rank 0 must pass share() the state consolidate() returned in the old group: in sharded "
    "modes no rank of the new group holds the whole state otherwise"
)


def _share_fully_sharded(
    strategy: Strategy, tree: dict[str, Any] | None, root: int, expects: Expects
) -> tuple[dict[str, Any], int]:
    """FSDP2: each whole tensor, as it arrives, becomes this rank's shard of it (placed as the
    rebuilt model's and optimizer's own DTensors are, cut locally: ``distribute_tensor`` with
    ``src_data_rank=None``), then DCP loads that sharded state. (DCP's own
    ``broadcast_from_rank0`` would unpickle rank 0's structure.)"""
    from torch.distributed.checkpoint.state_dict import (
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.tensor import DTensor, distribute_tensor

    layout = strategy.layout
    # the layout of every tensor here, and an optimizer state to load into
    model_like, optim_sd = get_state_dict(strategy.model, strategy.optimizer)
    optim_like: dict[str, Any] = dict(optim_sd["state"])  # type: ignore[arg-type]

    def keep(path: tuple[Any, ...], tensor: torch.Tensor) -> torch.Tensor:
        like: Any = None
        if len(path) == 2 and path[0] == "model":
            like = model_like.get(path[1])
        elif len(path) == 4 and path[:2] == ("optim", "state"):
            like = optim_like.get(path[2], {}).get(path[3])
        if like is None or not is_dtensor(like):
            return tensor  # whole on every rank: a buffer, a step count
        part = distribute_tensor(tensor, like.device_mesh, like.placements, src_data_rank=None)
        return DTensor.from_local(
            part.to_local().clone(),  # not a view: the whole tensor goes once this returns
            like.device_mesh,
            like.placements,
            shape=like.shape,
            stride=like.stride(),
            run_check=False,
        )

    state, nbytes = broadcast_tree(
        tree, src=root, group=layout.group, device=layout.device, expects=expects, keep=keep
    )
    if state is None:  # this rank is src and has nothing: the others raised
        raise ConfigError(_NOTHING)
    set_model_state_dict(strategy.model, state["model"])
    if state["optim"]["state"]:
        set_optimizer_state_dict(strategy.model, strategy.optimizer, state["optim"])
    return state, nbytes


def share_tree(strategy: Strategy, tree: Any) -> tuple[Any, int]:
    """Give every rank of the strategy's group rank 0's ``tree``, the best epoch's weights (a
    snapshot: the model's entries by name, or None) and the bytes it took. Collective; what the
    other ranks pass is ignored; a receiver accepts only its own model's entries, in their
    shapes."""
    layout = strategy.layout
    group = layout.group
    root = 0 if group is None else dist.get_global_rank(group, 0)
    wrapped = {"tree": tree} if layout.rank == 0 else None
    expects = Expects.of_model(_model_entries(strategy), entries=(("tree",),))
    got, nbytes = broadcast_tree(
        wrapped, src=root, group=group, device=layout.device, expects=expects
    )
    return host_copy(got["tree"]), nbytes
