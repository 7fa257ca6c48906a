"""Undo ``fully_shard`` when training ends: every rank gets the whole model back, as a plain module.

In ``fully_sharded`` mode each parameter is a DTensor of which a rank holds one shard, and FSDP2
hooks every forward (all-gather), backward (reduce-scatter), ``state_dict`` and
``load_state_dict`` of the model: none of that works once the process group is gone. When a run
ends, :func:`unshard` gathers every parameter whole on every rank (one all-gather each, in the
same order everywhere: a collective) and turns the model back into the module the user built: its
original classes, plain ``nn.Parameter`` tensors, no FSDP hooks. The optimizer that trained it
held the shards; it is not converted.
"""

from __future__ import annotations

from collections import OrderedDict
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


def unshard(model: nn.Module) -> None:
    """Gather ``model``'s sharded parameters whole on every rank and drop FSDP2. Collective."""
    whole: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for param in model.parameters():  # the same order on every rank
            if is_dtensor(param):
                whole[id(param)] = param.full_tensor().detach().clone()  # type: ignore[attr-defined]
    for module in model.modules():
        module.__class__ = _plain_class(type(module))
        for table in _HOOK_TABLES:
            hooks: OrderedDict[int, Any] = getattr(module, table)
            for key in [k for k, h in hooks.items() if _from_fsdp(h)]:
                del hooks[key]
        for name, held in list(module._parameters.items()):
            if held is not None and id(held) in whole:
                module._parameters[name] = nn.Parameter(
                    whole[id(held)], requires_grad=held.requires_grad
                )
    left = [n for n, p in model.named_parameters() if is_dtensor(p)]
    if left:  # pragma: no cover - a torch whose FSDP2 keeps parameters elsewhere
        raise RuntimeError(f"parameters still sharded after gathering: {', '.join(left)}")
