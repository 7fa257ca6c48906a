"""What a checkpoint holds: the ``Stateful`` protocol and the adapters that implement it.

``torch.distributed.checkpoint`` (DCP) saves and loads objects with ``state_dict()`` and
``load_state_dict(sd)``. :class:`~epochal.worker.checkpoints.checkpoint.Checkpointer` and
:class:`~epochal.worker.session.Session` take any such :class:`Stateful`; the strategies of
:mod:`epochal.worker.strategies` hand out the adapters below, one per way a mode holds the model
and the optimizer:

- :class:`TrainState`: model and optimizer through DCP's ``get_state_dict`` (replicated,
  fully_sharded; the format the others follow);
- :class:`ModelState`: the model alone (the best epoch's weights);
- :class:`BuffersFromRoot`: another adapter, with rank 0's buffers on every rank first (DDP modes);
- :class:`MainState`: every rank's model, rank 0's optimizer (main);
- :class:`ShardedState`: the model and each rank's shard of ZeRO's optimizer state (sharded);
- :class:`WholeOnRoot`: another adapter, marked as whole on rank 0, whose checkpoints rank 0
  alone may write while the next epoch trains (replicated, main; :func:`whole_on_root` asks).

The optimizer state is always keyed by parameter name, in the format of DCP's ``get_state_dict``.
This module imports nothing else of epochal's worker but the tensor helpers, so the strategies,
the training loop and the session can all import it.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from epochal.errors import EpochalError
from epochal.worker.training.initialization import broadcast_tensors


class Stateful(Protocol):
    """``torch.distributed.checkpoint``'s Stateful protocol: what a checkpoint holds."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class TrainState:
    """Model and optimizer as one ``torch.distributed.checkpoint`` Stateful.

    Uses DCP's ``get_state_dict``/``set_state_dict``, which key optimizer state by parameter name
    and work the same for plain, DDP, ZeRO and FSDP2 models.
    """

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, model_only: bool = False
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.model_only = model_only

    def state_dict(self) -> dict[str, Any]:
        # imported here: torch.distributed.checkpoint costs ~1 s at import, paid only when used
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd} if self.model_only else {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if self.model_only:
            set_model_state_dict(self.model, state["model"])
        else:
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
            )


class ModelState:
    """The model alone as a DCP Stateful (restoring the best epoch's weights)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {"model": get_model_state_dict(self.model)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, state["model"])


class BuffersFromRoot:
    """A DDP mode's checkpoint: ``inner``, with rank 0's buffers on every rank before it is read.

    DDP broadcasts rank 0's buffers (BatchNorm statistics) before each forward, so between
    forwards the other ranks hold rank 0's plus one batch of their own; a checkpoint keeps one
    copy of each replicated tensor, written by whichever rank DCP picks. Giving every rank rank
    0's first makes that copy rank 0's, and a resumed run equal to an uninterrupted one.
    """

    def __init__(self, inner: Stateful, ddp: DistributedDataParallel) -> None:
        self.inner = inner
        self.ddp = ddp

    def state_dict(self) -> dict[str, Any]:
        buffers = list(self.ddp.module.buffers())
        if self.ddp.broadcast_buffers and buffers:  # collective: DCP asks every rank
            root = dist.get_global_rank(self.ddp.process_group, 0)
            broadcast_tensors(buffers, src=root, group=self.ddp.process_group)
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


class WholeOnRoot:
    """``inner``, whose part on rank 0 is the whole state: every tensor a checkpoint holds.

    Rank 0 alone can then write the checkpoint, from a copy in host memory, while the next epoch
    trains (:meth:`~epochal.worker.checkpoints.checkpoint.Checkpointer.save_behind`); the other
    modes' checkpoints need every rank's part and are written at the boundary. ``inner`` is still
    taken on every rank, on the main thread, so what it does collectively (rank 0's buffers onto
    every rank: :class:`BuffersFromRoot`) happens as for any checkpoint.
    """

    whole_on_root = True

    def __init__(self, inner: Stateful) -> None:
        self.inner = inner

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


def whole_on_root(state: object) -> bool:
    """Whether ``state``'s part on rank 0 is the whole state: a :class:`WholeOnRoot`, or an
    adapter around one that says so through its own ``whole_on_root`` (the loss scaler's, whose
    state every rank holds alike, and fit's, which adds each rank's own stream position)."""
    return getattr(state, "whole_on_root", False) is True


class MainState:
    """Main mode's checkpoint: every rank's model, rank 0's optimizer (the only one with state).

    Rank 0's part has the format of :class:`TrainState`.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, is_root: bool) -> None:
        self.model = model
        self.optimizer = optimizer
        self.is_root = is_root

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if not self.is_root:
            return {"model": get_model_state_dict(self.model)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if not self.is_root:
            set_model_state_dict(self.model, state["model"])
            return
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )


def _init_state(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer without state its state tensors: a step with zero gradients at lr 0.

    DCP's ``get_state_dict`` does the same, so that a fresh optimizer has tensors to load into.
    """
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    lrs = [group.get("lr") for group in optimizer.param_groups]
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        if lr is not None:
            group["lr"] = torch.tensor(0.0) if isinstance(lr, torch.Tensor) else 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        if lr is not None:
            group["lr"] = lr
    for p, g in zip(params, grads, strict=True):
        p.grad = g


class ShardedState:
    """ZeRO's checkpoint: the model, and each rank's own shard of the optimizer state.

    Keyed by parameter name in DCP's ``get_state_dict`` format (``optim.state.<name>.<key>``,
    ``optim.param_groups`` with parameter names): each rank writes the state of the parameters it
    owns, so the shards are disjoint, and loads those it owns now, whatever rank wrote them.
    """

    def __init__(self, model: nn.Module, zero: Any) -> None:
        self.model = model
        self.zero = zero
        self.names = {id(p): name for name, p in model.named_parameters()}

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        local: torch.optim.Optimizer = self.zero.optim
        _init_state(local)
        state = {
            self.names[id(p)]: dict(local.state[p])
            for group in local.param_groups
            for p in group["params"]
            if p in local.state
        }
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": self._names(g)}
            for g in self.zero.param_groups
        ]
        return {
            "model": get_model_state_dict(self.model),
            "optim": {"state": state, "param_groups": groups},
        }

    def _names(self, group: dict[str, Any]) -> list[str]:
        return [self.names[id(p)] for p in group["params"]]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, state["model"])
        saved = state["optim"]
        if [g["params"] for g in saved["param_groups"]] != [
            self._names(g) for g in self.zero.param_groups
        ]:
            raise EpochalError(
                "the checkpoint's optimizer has other parameter groups than this one: build the "
                "optimizer with the same groups the run was started with"
            )
        local: torch.optim.Optimizer = self.zero.optim
        own_state: dict[int, Any] = {}
        own_groups = []
        index = 0
        for g_local, g_saved, g_zero in zip(
            local.param_groups, saved["param_groups"], self.zero.param_groups, strict=True
        ):
            hyper = {k: v for k, v in g_saved.items() if k != "params"}
            g_zero.update(hyper)
            ids = []
            for p in g_local["params"]:
                if self.names[id(p)] in saved["state"]:
                    own_state[index] = saved["state"][self.names[id(p)]]
                ids.append(index)
                index += 1
            own_groups.append({**hyper, "params": ids})
        local.load_state_dict({"state": own_state, "param_groups": own_groups})
