"""Leaving a broken (or outgrown) process group so that its sockets close, and building the
same strategy again over the next one.

A process group closes its connections only when the last reference to it goes. Destroying it
(``dist.destroy_process_group``) drops torch's own registry; what else holds one, each found by a
test that saw a peer blocked until the collective timeout: a DDP wrapper, a
ZeroRedundancyOptimizer, FSDP2's state (the strategy releases them all), the frames an exception's
traceback keeps alive (:func:`clear_frames`), a local variable of the caller's; and, inside torch,
import-time default arguments and the device meshes DTensor's caches keep, which
:mod:`epochal.worker.dataplane.torchinternals` keeps empty of groups (the one module that relies
on torch beyond its public API). Each world builds its own device mesh over its own group, and
the strategy makes it drop that group when it releases it. With gloo nothing else ends
a blocked collective: ``ProcessGroup.abort()`` and ``shutdown()`` return at once and leave it
blocked until its timeout (torch 2.13 and 2.14). Once the sockets close, a peer blocked in a
collective with this rank raises at once ("Connection closed by peer"), so the survivors of a lost
rank all get out of the broken epoch and can meet again. :func:`leave` drops every such reference
it can reach and destroys the group; :func:`rebuild` builds the same mode with the same options
over the new group, around the same model object.
"""

from __future__ import annotations

import dataclasses
import gc
import time
import traceback

import torch.distributed as dist
from torch import nn

from epochal.errors import ConfigError
from epochal.worker.dataplane import torchinternals
from epochal.worker.dataplane.sockets import restore_excepthook
from epochal.worker.strategies.layout import Layout
from epochal.worker.strategies.strategy import Strategy
from epochal.worker.training.placement import LayeredModel

torchinternals.prepare()  # before any group forms: torch's import-time defaults must hold none


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


def _destroy() -> None:
    """Destroy the default process group, aborting it first on NCCL (which ends its pending
    kernels; gloo's abort ends nothing), and put back the excepthook it wrapped."""
    group = dist.group.WORLD
    if group is not None and "nccl" in str(dist.get_backend(group)):
        group.abort()
    del group
    restore_excepthook()
    dist.destroy_process_group()


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
        _destroy()
    gc.collect()  # wrappers caught in reference cycles hold the group until collected
    return time.perf_counter() - start


def close_group() -> None:
    """Destroy the default process group at the end of a finished run and let it close now, while
    the interpreter is whole: its threads ended before this returns (gloo's).

    Destroying the group alone leaves it open while anything holds it (a DDP wrapper in a
    reference cycle, a strategy not released: see :func:`leave`), and with it
    gloo's worker threads, one of which may still hold the last reference to the tensors of the
    collective it just ran. Dropped there while the interpreter exits, a tensor whose Python object
    it keeps takes the GIL, which then ends the thread mid-destructor: ``terminate called without
    an active exception``, SIGABRT, after the run finished (seen on a loaded machine). So the
    garbage is collected and the last reference, this
    function's, goes last: torch's binding releases the GIL while the group's destructor joins
    its threads. A group the caller still holds (its own DDP wrapper)
    stays open until the caller drops it, as before. Only for a run every rank finished: a
    collective left blocked (a failed run) would keep the destructor waiting for its timeout."""
    if not dist.is_initialized():
        return
    group = dist.group.WORLD
    restore_excepthook()
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
