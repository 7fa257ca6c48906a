"""Spawned gloo ranks for the worker's multi-process tests: start them, bound them, clean up."""

from __future__ import annotations

import faulthandler
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def start_rank(rank: int, world: int, store: str, deadline: float) -> None:
    """In a spawned rank: one thread, a stack dump before ``deadline``, a gloo process group."""
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(deadline - 10, exit=True)  # a hang dumps its stacks
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )


def run_ranks(fn: Callable[..., None], world: int, tmp: Path, *args: Any, deadline: float) -> None:
    """Run ``fn(rank, world, store_file, *args)`` in ``world`` spawned processes.

    Fails the test (after killing every rank) when they are not done by ``deadline`` seconds; a
    rank that raises fails it with that rank's traceback.
    """
    ctx = mp.start_processes(
        fn,
        args=(world, str(tmp / "store"), *args),
        nprocs=world,
        join=False,
        start_method="spawn",
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
