"""The launchers the benchmarks time epochal against: their command lines and environment.

``compare.py``, ``cadence.py``, ``checkpoint_cost.py``, ``faults.py`` and ``preload.py`` start
their runs with these, so that a baseline under plain torchrun and a run under ``epochal run``
start alike: from this interpreter (``python -m torch.distributed.run``, the module behind
``torchrun``, and ``python -m epochal``), on one machine, with one OpenMP thread and nothing of
the calling shell's epochal settings.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def launch_env() -> dict[str, str]:
    """This process's environment for a launcher: ``OMP_NUM_THREADS=1``, and no ``EPOCHAL_*``
    variable (no coordinator address, progress bar or token leaking in)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def torchrun_command(nproc: int, *rest: str) -> list[str]:
    """torchrun with ``nproc`` workers on this machine, rendezvousing (c10d) on a free loopback
    port, then ``rest``: more launcher options, the script and its arguments."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:0",
        *rest,
    ]


def epochal_run_command(nproc: int, epochs: int, run_dir: Path, *rest: str) -> list[str]:
    """``epochal run`` of ``nproc`` workers for ``epochs`` epochs, its journal and checkpoints in
    ``run_dir``, then ``rest``: more launcher options, the script and its arguments."""
    return [
        sys.executable,
        "-m",
        "epochal",
        "run",
        "--nproc",
        str(nproc),
        "--epochs",
        str(epochs),
        "--run-dir",
        str(run_dir),
        *rest,
    ]
