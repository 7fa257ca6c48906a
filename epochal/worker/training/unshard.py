"""Undo ``fully_shard`` when training ends: every rank gets the whole model back, as a plain module.

In ``fully_sharded`` mode each parameter is a DTensor of which a rank holds one shard, and FSDP2
hooks every forward (all-gather), backward (reduce-scatter), ``state_dict`` and
``load_state_dict`` of the model: none of that works once the process group is gone. When a run
ends, :func:`unshard` gathers every parameter whole on every rank (one all-gather each, in the
same order everywhere: a collective) and turns the model back into the module the user built: its
original classes, plain ``nn.Parameter`` tensors, no FSDP hooks or state. The optimizer that
trained it held the shards; it is not converted.

When the process group is lost instead (a rank died: :mod:`epochal.worker.regroup`), nothing can be
gathered: :func:`drop_shards` undoes ``fully_shard`` on this rank alone, each parameter becoming a
plain parameter of its whole shape on the meta device (no memory, no values), so that the same
module object can be sharded anew over the next group and its values loaded there. Both leave no
reference to the old mesh or its process group in the module.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from epochal.worker.training.initialization import is_dtensor

_FSDP_PACKAGE = "torch.distributed.fsdp"
_HOOK_TABLES = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_state_dict_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
"""Where ``nn.Module`` keeps the hooks FSDP2 registers on a module it shards."""


def _from_fsdp(hook: Any) -> bool:
    fn = getattr(hook, "hook", hook)  # load-state-dict pre-hooks come wrapped
    fn = getattr(fn, "func", fn)  # functools.partial
    return str(getattr(fn, "__module__", "") or "").startswith(_FSDP_PACKAGE)


def _plain_class(cls: type) -> type:
    """The class ``fully_shard`` derived ``FSDP<cls>`` from (``cls`` itself if it did not)."""
    from torch.distributed.fsdp import FSDPModule

    if not issubclass(cls, FSDPModule):
        return cls
    return next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))


def _state_keys() -> tuple[str, ...]:
    """The keys under which ``fully_shard`` (a composable API) keeps its state and registry in a
    module's ``__dict__``: the state holds the mesh, and the mesh its process groups."""
    from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY

    return (STATE_KEY, REGISTRY_KEY)


def _forget_state(module: nn.Module) -> None:
    """Drop the entry torch keeps for ``module`` in its table of composable states (weakly
    keyed by module: it lives as long as the module, and fully_shard refuses a module in it)."""
    from torch.distributed._composable_state import _module_state_mapping

    _module_state_mapping.pop(module, None)


_FSDP_FLAGS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")
"""Attributes ``fully_shard`` sets on every module it manages."""


def _undo_fully_shard(
    model: nn.Module, replace: Callable[[torch.Tensor], torch.Tensor | None]
) -> None:
    """Every module of ``model`` back to its own class, without FSDP2's hooks and state; each
    parameter (a DTensor shard, or the whole tensor FSDP2 put in its place mid-step) replaced by
    ``replace(param)`` as a plain parameter (None: kept), shared parameters staying shared."""
    keys = _state_keys()
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        module.__class__ = _plain_class(type(module))
        for table in _HOOK_TABLES:
            hooks: OrderedDict[int, Any] = getattr(module, table)
            for key in [k for k, h in hooks.items() if _from_fsdp(h)]:
                del hooks[key]
        for attribute in (*keys, *_FSDP_FLAGS):
            module.__dict__.pop(attribute, None)
        _forget_state(module)
        for name, held in list(module._parameters.items()):
            if held is None:
                continue
            if id(held) not in new:
                with torch.no_grad():
                    value = replace(held)
                new[id(held)] = (
                    held if value is None else nn.Parameter(value, requires_grad=held.requires_grad)
                )
            module._parameters[name] = new[id(held)]
    left = [n for n, p in model.named_parameters() if is_dtensor(p)]
    if left:  # pragma: no cover - a torch whose FSDP2 keeps parameters elsewhere
        raise RuntimeError(f"parameters still sharded after undoing fully_shard: {', '.join(left)}")


def unshard(model: nn.Module) -> None:
    """Gather ``model``'s sharded parameters whole on every rank and drop FSDP2. Collective."""
    whole: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for param in model.parameters():  # the same order on every rank
            if is_dtensor(param):
                whole[id(param)] = param.full_tensor().detach().clone()  # type: ignore[attr-defined]
    _undo_fully_shard(model, lambda held: whole.get(id(held)))


def drop_shards(model: nn.Module) -> None:
    """Drop FSDP2 from ``model`` without communicating (its process group may be gone): each
    parameter becomes a plain parameter of its whole shape and dtype on the meta device. Its
    values are lost with the shards: shard the module anew and load them (a checkpoint, or
    :func:`epochal.worker.regroup.share`). Buffers, which FSDP2 never shards, keep theirs."""
    _undo_fully_shard(model, lambda held: torch.empty(held.shape, dtype=held.dtype, device="meta"))
