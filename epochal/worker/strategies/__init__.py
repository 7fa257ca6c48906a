"""Optimization modes: how gradients are combined and who holds the optimizer state.

:func:`wrap` turns a model and its optimizer into a :class:`Strategy` for one of four modes,
chosen per run (``fit(..., mode=...)``):

============== ============================================ ==================================
mode           gradients                                    optimizer state / parameters
============== ============================================ ==================================
replicated     DDP all-reduce (average), bucketed,          every rank holds it all and steps
               overlapped with backward                     (the default)
main           reduced (average) onto rank 0 in buckets     only rank 0 holds state and steps;
               when the step comes                          parameters broadcast back
sharded        DDP all-reduce (average)                     ZeroRedundancyOptimizer: each rank
                                                            holds and steps ~1/N of the state;
                                                            parameters stay whole
fully_sharded  FSDP2 reduce-scatter (average)               ``fully_shard``: parameters,
                                                            gradients and state all ~1/N
============== ============================================ ==================================

``main`` is burn's ``OptimMainDevice`` and lamp's root optimizer, ``sharded`` burn's
``OptimSharded``; ``fully_sharded`` is the fully sharded option of ``sharded``, for models whose
parameters do not fit one device. Every mode *averages* gradients (burn sums them, so its results
change with the device count), and every mode starts from rank 0's parameters, so after each step
all modes hold the same weights as ``replicated``, up to float rounding.

A :class:`Strategy` is what the training loop talks to: ``module`` for the training forward,
``step()``, ``zero_grad()``, ``no_sync()`` around batches that only accumulate gradients,
``optimizer`` (whose ``param_groups`` take the learning rate), ``policy``
(:class:`~epochal.worker.training.precision.StepPolicy`: the forward runs under
``policy.autocast()``, the backward through ``policy.backward(loss)``; ``step()`` unscales and clips
the combined gradients with it), and ``state``, a ``torch.distributed.checkpoint`` Stateful that
saves and loads the model and the optimizer the way the mode holds them
(:mod:`epochal.worker.checkpoints.state`: ZeRO's shards keyed by parameter name, FSDP2's DTensors
through ``torch.distributed.checkpoint.state_dict``), and with fp16 the loss scaler. The optimizer
state is always keyed by parameter name, in the format of DCP's ``get_state_dict``.

The package has one module per mode (:mod:`.replicated`, :mod:`.main`, :mod:`.sharded`,
:mod:`.fully_sharded`), the interface they implement (:mod:`.base`: :class:`Strategy`,
:class:`Mode`), the DDP modes' shared part (:mod:`.ddp`), where and among whom the model trains
(:mod:`.layout`: :class:`Layout`, the device, process group, rank and world size every mode is
built from and reads them from), the options (:mod:`.options`) and the list of modes with
:func:`wrap` (:mod:`.registry`). The checkpoint adapters the modes hand out live
in :mod:`epochal.worker.checkpoints.state`.

The optimizer passed in is the one that steps in ``replicated`` and ``main``. ``sharded`` and
``fully_sharded`` build their own of the same class, with the same parameter groups and
hyperparameters (ZeRO's local shard optimizer; a new one over FSDP2's sharded parameters), so the
passed optimizer is left without state: use ``Strategy.optimizer``.
"""

from epochal.worker.checkpoints.state import ModelState, Stateful
from epochal.worker.strategies.fully_sharded import FullySharded
from epochal.worker.strategies.layout import Layout
from epochal.worker.strategies.main import Main
from epochal.worker.strategies.modeoptions import ModeOptions, mode_options
from epochal.worker.strategies.modes import MODES, STRATEGIES, strategy_class, to_device, wrap
from epochal.worker.strategies.replicated import Replicated
from epochal.worker.strategies.sharded import Sharded
from epochal.worker.strategies.strategy import Mode, Strategy

__all__ = [
    "MODES",
    "STRATEGIES",
    "FullySharded",
    "Layout",
    "Main",
    "Mode",
    "ModeOptions",
    "ModelState",
    "Replicated",
    "Sharded",
    "Stateful",
    "Strategy",
    "mode_options",
    "strategy_class",
    "to_device",
    "wrap",
]
