"""Leaving a broken (or outgrown) process group so that its sockets close, and building the
same strategy again over the next one.

A process group closes its connections only when the last reference to it goes. Destroying it
drops torch's own registry; what else holds one (torch 2.13, each found by a test that saw a
peer blocked until the collective timeout): a DDP wrapper, a ZeroRedundancyOptimizer, the frames
an exception's traceback keeps alive, a local variable of the caller's; default arguments
evaluated at import (``torch.distributed.nn.functional``'s collectives, ZeRO's
``_broadcast_object``: ``group=group.WORLD``); and device meshes, which keep their groups and
which DTensor's sharding caches keep alive once a model has been fully sharded. With gloo nothing
else ends a blocked collective: ``ProcessGroup.abort()``, ``shutdown()`` and
``_abort_process_group()`` return at once and leave it blocked until its timeout. Once the
sockets close, a peer blocked in a collective with this rank raises at once ("Connection closed
by peer"), so the survivors of a lost rank all get out of the broken epoch and can meet again.
:func:`leave` drops every such reference it can reach and destroys the group; :func:`rebuild`
builds the same mode with the same options over the new group, around the same model object.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import time
import traceback
import types
import warnings

import torch.distributed as dist
from torch import nn

from epochal.errors import ConfigError
from epochal.worker.strategies.base import Strategy
from epochal.worker.strategies.layout import Layout
from epochal.worker.training.placement import LayeredModel

_IMPORTED_BEFORE_ANY_GROUP = frozenset() if dist.is_initialized() else frozenset(sys.modules)
"""The modules imported before this one while no process group existed: a default argument they
evaluated at import (``group=group.WORLD``) was None, so none of them can hold a group."""


def clear_frames(error: BaseException) -> None:
    """Clear the local variables of every frame ``error``'s traceback keeps (and those of the
    errors it was raised from or during): they may hold the DDP wrapper, the optimizer or the
    mesh of the group the error came from. The traceback still prints (files, lines, names)."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        exc = pending.pop()
        if id(exc) in seen:
            continue
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)  # skips the frames still executing
        pending.extend(e for e in (exc.__cause__, exc.__context__) if e is not None)
        if isinstance(exc, BaseExceptionGroup):
            pending.extend(exc.exceptions)


def _functions(module: types.ModuleType) -> list[types.FunctionType]:
    """The functions ``module`` defines or imports, and the methods of the classes it defines."""
    out = []
    with warnings.catch_warnings():  # torch.distributed's deprecated names warn when looked at
        warnings.simplefilter("ignore", FutureWarning)
        for value in list(vars(module).values()):
            candidates = [value]
            if isinstance(value, type) and value.__module__ == module.__name__:
                candidates += list(vars(value).values())
            for fn in candidates:
                if isinstance(fn, staticmethod | classmethod):
                    fn = fn.__func__
                if isinstance(fn, types.FunctionType):
                    out.append(fn)
    return out


def _forget_import_time_group(group: dist.ProcessGroup) -> int:
    """Drop the references torch's own modules keep to ``group`` as default arguments; return how
    many functions held one.

    Functions such as ``torch.distributed.nn.functional.all_reduce`` or ZeRO's
    ``_broadcast_object`` declare ``group=group.WORLD``, evaluated once, when their module is
    first imported: DDP imports the first the first time one is built, ZeroRedundancyOptimizer
    the second, so those defaults hold the group of that moment for the life of the process, and
    destroying that group closes nothing (torch 2.13). None is what they read as the default
    group, whichever it is then. Every ``torch.distributed`` module imported since a group may
    have existed is searched, so a module that does the same in another torch release is covered
    too; those imported before (:data:`_IMPORTED_BEFORE_ANY_GROUP`, most of them where the
    process was forked from one that imported them) are not: searching them all took 0.05 s of
    every rank's exit."""
    held = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("torch.distributed") or not isinstance(module, types.ModuleType):
            continue
        if name in _IMPORTED_BEFORE_ANY_GROUP:
            continue
        for fn in _functions(module):
            defaults, keywords = fn.__defaults__ or (), fn.__kwdefaults__ or {}
            if any(d is group for d in defaults):
                fn.__defaults__ = tuple(None if d is group else d for d in defaults)
                held += 1
            if any(v is group for v in keywords.values()):
                fn.__kwdefaults__ = {k: None if v is group else v for k, v in keywords.items()}
                held += 1
    return held


def _forget_meshes(group: dist.ProcessGroup) -> int:
    """Drop the references live device meshes keep to ``group``; return how many meshes held one.

    A ``DeviceMesh`` (FSDP2's, a DTensor's) keeps the process groups of its dimensions, and
    DTensor's sharding-propagation caches keep the specs of the DTensors they have seen, and
    with them their mesh, for the life of the process: once a model has been fully sharded, the
    group stays open after it is destroyed (torch 2.13). Every mesh still alive forgets it."""
    module = sys.modules.get("torch.distributed.device_mesh")
    mesh_class = getattr(module, "DeviceMesh", None)
    if not isinstance(mesh_class, type):
        return 0
    held = 0
    # each type tested once: isinstance on every live object runs the class's Python-level
    # __instancecheck__ once per object (0.4 s with torch loaded, on a 2-core machine)
    is_mesh: dict[type, bool] = {}
    meshes = []
    with warnings.catch_warnings():  # a deprecated torch class warns when it is tested
        warnings.simplefilter("ignore", FutureWarning)
        for obj in gc.get_objects():
            kind = type(obj)
            found = is_mesh.get(kind)
            if found is None:
                found = is_mesh[kind] = issubclass(kind, mesh_class)
            if found:
                meshes.append(obj)
    for obj in meshes:
        found = False
        for value in vars(obj).values():
            if isinstance(value, dict):
                for key in [k for k, v in value.items() if v is group or k is group]:
                    del value[key]
                    found = True
            elif isinstance(value, list) and any(v is group for v in value):
                value[:] = [v for v in value if v is not group]
                found = True
        held += found
    return held


def _unwrap_excepthook() -> None:
    """``init_process_group`` wraps ``sys.excepthook`` in a function that prefixes every line
    with the rank (``[rank2]:``), and the next one wraps that again: after a regroup a traceback
    would carry the rank of every world the process was in. The group's wrapper goes with it."""
    hook = sys.excepthook
    if not (
        isinstance(hook, types.FunctionType)
        and hook.__qualname__ == "init_process_group.<locals>._distributed_excepthook"
        and "old_hook" in hook.__code__.co_freevars
        and hook.__closure__ is not None
    ):
        return
    cell = hook.__closure__[hook.__code__.co_freevars.index("old_hook")]
    sys.excepthook = cell.cell_contents


def _abort_and_forget() -> None:
    """NCCL can abort its communicators, which ends their pending kernels (gloo cannot); and
    neither an import-time default nor a device mesh may keep the group past its destruction."""
    group = dist.distributed_c10d._get_default_group()
    _forget_import_time_group(group)
    _forget_meshes(group)
    _unwrap_excepthook()
    if "nccl" in str(dist.get_backend(group)):
        group.abort()


def leave(strategy: Strategy | None = None, error: BaseException | None = None) -> float:
    """Leave the current default process group, so that its sockets close; return the seconds it
    took.

    ``strategy``, built over that group, releases it (``Strategy.release_group``: no DDP wrapper,
    no ZeroRedundancyOptimizer, FSDP2 undone, its model and the options kept for
    :func:`rebuild`). ``error``, the collective's failure that made this rank leave, has the frames
    its traceback keeps cleared. On NCCL the group is aborted first. Then the group is destroyed
    (and torch's own import-time references to it dropped) and the garbage collected. Anything
    else of the caller's that refers to the group must be gone by then: the objects the strategy
    handed out before (``strategy.module``, ``strategy.optimizer``, ``strategy.state``), local
    variables holding a wrapper, an autograd graph of the broken step (a loss). No
    communication: it works with peers dead or blocked.
    """
    start = time.perf_counter()
    if error is not None:
        clear_frames(error)
    if strategy is not None:
        # the broken step's gradients mean nothing in the next world; and an optimizer without
        # state whose parameters hold gradients is one DCP will not initialise, so a restore
        # (memory or checkpoint) would load no optimizer state into it, silently (torch 2.13)
        strategy.model.zero_grad(set_to_none=True)
        strategy.optimizer.zero_grad(set_to_none=True)
        strategy.release_group()
    if dist.is_initialized():
        _abort_and_forget()
        dist.destroy_process_group()
    gc.collect()  # wrappers caught in reference cycles hold the group until collected
    return time.perf_counter() - start


def close_group() -> None:
    """Destroy the default process group at the end of a finished run and let it close now, while
    the interpreter is whole: its threads ended before this returns (gloo's).

    Destroying the group alone leaves it open while anything holds it (a DDP wrapper in a
    reference cycle, torch's import-time defaults, a device mesh: see :func:`leave`), and with it
    gloo's worker threads, one of which may still hold the last reference to the tensors of the
    collective it just ran. Dropped there while the interpreter exits, a tensor whose Python object
    it keeps takes the GIL, which then ends the thread mid-destructor: ``terminate called without
    an active exception``, SIGABRT, after the run finished (seen on a loaded machine). So the
    defaults and meshes forget the group, the garbage is collected and the last reference, this
    function's, goes last: torch's binding releases the GIL while the group's destructor joins
    its threads. A group the caller still holds (its own DDP wrapper)
    stays open until the caller drops it, as before. Only for a run every rank finished: a
    collective left blocked (a failed run) would keep the destructor waiting for its timeout."""
    if not dist.is_initialized():
        return
    group = dist.distributed_c10d._get_default_group()
    _forget_import_time_group(group)
    _forget_meshes(group)
    dist.destroy_process_group()
    gc.collect()  # the wrappers in reference cycles, each holding the group
    del group  # the last reference, when nothing else holds one: the threads end here


def rebuild(strategy: Strategy, layout: Layout) -> Strategy:
    """The mode of ``strategy`` built again over ``layout``'s group (after :func:`leave` and a new
    ``init_process_group``), with the same options, DDP options and hooks, and the same precision
    policy (its loss scaler too); collective over the new group, as ``Strategy.build`` is.

    The model object stays the one the user passed in: ``replicated`` and ``main`` also keep the
    optimizer and its state; ``sharded`` shards the optimizer anew (no state), and
    ``fully_sharded`` shards the module anew with empty shards. Restore its state next
    (:meth:`Snapshot.restore`, a checkpoint, or :func:`~epochal.worker.regroup.share.share`).
    """
    if not strategy.released:
        raise ConfigError(
            "this strategy still holds its process group: leave() it before rebuilding it over "
            "the next one"
        )
    old = strategy.layout
    if layout.device != old.device:
        raise ConfigError(
            f"a strategy trained on {old.device} cannot be rebuilt on {layout.device}: a process "
            "keeps its device across worlds; build the layout with the same device"
        )
    layout = dataclasses.replace(layout, placed=isinstance(strategy.model, LayeredModel))
    if strategy.opts.sync_batchnorm:
        for module in strategy.model.modules():
            if isinstance(module, nn.SyncBatchNorm):
                module.process_group = layout.group
    new = type(strategy).build(
        strategy.model, strategy.optimizer, layout, strategy.opts, strategy.ddp_options
    )
    new.policy = strategy.policy
    new.opts, new.ddp_options = strategy.opts, strategy.ddp_options
    new.configure = strategy.configure
    return new
