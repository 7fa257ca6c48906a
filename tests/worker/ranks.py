"""Spawned ranks for the worker's multi-process tests: start them (gloo on CPU, or NCCL with one
GPU each), bound them, clean up; and :class:`LocalSession`, what ``fit`` needs of a session
without a coordinator."""

from __future__ import annotations

import faulthandler
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from epochal.worker.checkpoints.checkpoint import Checkpointer
from epochal.worker.session import EpochContext, RunResult
from epochal.worker.sessionparts.savepoints import Savepoints
from epochal.worker.training.initialization import is_dtensor
from epochal.worker.training.results import LossSum

PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",  # imported by torch's optimizers when the first is built: 1.0-1.2 s a rank
    "torch.distributed.checkpoint",  # by every rank that saves one
    "torch.distributed.optim",  # by every rank of a sharded mode (ZeRO): 0.2-0.5 s
    "epochal.worker",
    "tests.worker.ranks",
    "tests.worker.elastic",
]
"""What the ranks' fork server imports once, before it forks any rank: without it every rank is a
fresh interpreter importing torch and epochal (about 3 s of CPU each; the worker tests start some
ninety ranks)."""


RANKS = pytest.mark.xdist_group("ranks")
"""The xdist group of every test that starts ranks from the fork server (:func:`run_ranks`,
:func:`tests.worker.elastic.spawn`): one test process runs them all, so the server imports
:data:`PRELOAD` once (3.7 core-seconds), not once in every test process that draws one of them;
the module-scoped groups of ranks are made once too."""


def rank_context() -> Any:
    """The multiprocessing context every test rank starts from: a fork server (one per test
    process, started on first use) that has imported :data:`PRELOAD`. It forks before any thread
    or process group exists; what a rank inherits of the test process's environment is what the
    environment held when the server started."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_rank(
    rank: int, world: int, store: str, deadline: float, backend: str = "gloo"
) -> torch.device:
    """In a spawned rank: one thread, a stack dump before ``deadline``, a process group; the
    rank's device: the CPU for gloo, GPU ``rank`` (modulo the GPUs there are) for NCCL."""
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(deadline - 10, exit=True)  # a hang dumps its stacks
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        store=dist.FileStore(store, world),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
        device_id=device if device.type == "cuda" else None,
    )
    return device


def run_ranks(fn: Callable[..., None], world: int, tmp: Path, *args: Any, deadline: float) -> None:
    """Run ``fn(rank, world, store_file, *args)`` in ``world`` processes (:func:`rank_context`).

    Fails the test (after killing every rank) when they are not done by ``deadline`` seconds; a
    rank that raises fails it with that rank's traceback.
    """
    rank_context()  # the fork server start_processes uses has PRELOAD imported
    ctx = mp.start_processes(
        fn,
        args=(world, str(tmp / "store"), *args),
        nprocs=world,
        join=False,
        start_method="forkserver",
    )
    end = time.monotonic() + deadline
    try:
        while not ctx.join(timeout=max(0.1, end - time.monotonic())):
            if time.monotonic() >= end:
                pytest.fail(f"{world} ranks still running after {deadline:g} s (stacks above)")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
            proc.join(5)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Whole parameters and buffers, on the CPU (collective for a fully sharded model)."""
    return {
        k: (v.full_tensor() if is_dtensor(v) else v).detach().to("cpu", copy=True)  # type: ignore[attr-defined]
        for k, v in model.state_dict().items()
    }


class StandIn:
    """The attributes ``fit`` reads of a Session, for a run without a coordinator whose world
    never changes: the stand-ins below share them, so a new one that ``fit`` reads is added
    here once."""

    def __init__(
        self,
        rank: int,
        world: int,
        *,
        resume_epoch: int | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.rank, self.world_size, self.resume_epoch = rank, world, resume_epoch
        self.device = torch.device("cpu") if device is None else device
        self.elastic, self.generation, self.restore = False, 0, "none"
        self.start_epoch = 0 if resume_epoch is None else resume_epoch + 1
        self.steps_per_epoch: int | None = None  # an epoch is one pass
        self.lr_steps: Any = None  # no per-step learning-rate schedule
        self.client = SimpleNamespace(check=lambda: None)


class LocalSession(StandIn):
    """What fit needs of a Session, without a coordinator: ``epochs`` epochs (learning-rate
    factor 0.5 per epoch), epoch 0 declared best, a checkpoint after each epoch (a real
    Checkpointer, through the session's Savepoints: rank 0 writes it in the background where its
    state is the whole), resume from ``resume_epoch``; on ``device``."""

    def __init__(
        self,
        rank: int,
        world: int,
        directory: Path,
        resume_epoch: int | None,
        model: list[Any],
        *,
        device: torch.device | None = None,
        epochs: int = 2,
    ) -> None:
        super().__init__(rank, world, resume_epoch=resume_epoch, device=device)
        self.epochs = epochs
        self.checkpointer = Checkpointer(directory, rank=rank, run_id="t")
        standing = SimpleNamespace(checkpointer=self.checkpointer, resume_epoch=None, rank=rank)
        self.savepoints = Savepoints(standing, lambda epoch: None)  # type: ignore[arg-type]
        self.model = model  # [the model fit trains], to read its weights at the end
        self.last: dict[str, torch.Tensor] = {}
        self.train_sums: list[LossSum] = []
        # what each epoch's training returned on this rank (the coordinator would sum them)

    def run_epochs(
        self,
        train_epoch: Any,
        valid_epoch: Any,
        *,
        batches: Any,
        on_best: Any,
        state: Any,
        rejoin: Any = None,
        learning_rate: Any = None,
        passes: Any = None,
    ) -> RunResult:
        start = 0
        if self.resume_epoch is not None:
            self.checkpointer.load(self.resume_epoch, state)
            start = self.resume_epoch + 1
        for epoch in range(start, self.epochs):
            ctx = EpochContext(
                epoch=epoch,
                train_batches=batches(epoch)[0],
                valid_batches=0,
                lr_factor=0.5**epoch,
                rank=self.rank,
                world_size=self.world_size,
                session=self,  # type: ignore[arg-type]
            )
            self.train_sums.append(train_epoch(ctx))
            if epoch == 0:
                on_best(0)
            self.savepoints.save(epoch, state, [])  # settled by the next save or load
        self.savepoints.settle()
        self.last = full_state(self.model[0])
        return RunResult(
            best_epoch=0,
            best_loss=0.0,
            epochs_run=self.epochs,
            rank=self.rank,
            world_size=self.world_size,
        )

    def load_checkpoint(self, epoch: int, state: Any) -> None:
        self.savepoints.load(epoch, state)

    def restore_best(self, result: RunResult, state: Any) -> RunResult:
        assert result.best_epoch is not None
        self.load_checkpoint(result.best_epoch, state)
        return result
