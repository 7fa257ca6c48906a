"""The GPU check at a small size, under pytest: every parallel mode in float32, bf16 and fp16 on
NCCL (one spawned rank per GPU) against the same on gloo/CPU ranks, and the digits example through
``epochal run`` on the GPUs against the CPU. Skipped, with the reason, without a CUDA device.

The checks and their tolerances are ``bench/gpu_check.py``'s (``bench/gpu_check.sh`` runs them at
full size and writes a report); each test here asserts one of its verdicts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.gpu_check import (
    PRECISIONS,
    SMALL,
    Check,
    compare_digits,
    compare_modes,
    digits_command,
    read_digits,
    run_modes,
)
from epochal.worker.strategies import MODES
from tests.gpu.conftest import NO_CUDA
from tests.integration.conftest import Spawner

pytestmark = [
    pytest.mark.slow,
    # one test process: the runs on every GPU (module-scoped) once, and no two runs share a GPU
    pytest.mark.xdist_group("gpu"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA),
]


@pytest.fixture(scope="module")
def mode_checks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Check]:
    world = torch.cuda.device_count()
    tmp = tmp_path_factory.mktemp("gpu-modes")
    on_gpus = run_modes("nccl", world, SMALL, tmp / "nccl")
    on_cpu = run_modes("gloo", world, SMALL, tmp / "gloo")
    return {c.name: c for c in compare_modes(on_gpus, on_cpu, "cuda")}


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_on_nccl_trains_as_on_the_cpu(mode_checks, mode, precision):
    verdict = mode_checks[f"modes {mode} {precision}"]
    assert verdict.passed, verdict.line()


def test_digits_through_epochal_run_on_the_gpus_trains_as_on_the_cpu(
    spawn: Spawner, tmp_path: Path, cuda_world: int
):
    runs = {}
    for device in ("cuda", "cpu"):
        run_dir = tmp_path / f"digits-{device}"
        args, env = digits_command(device, cuda_world, SMALL.digits_epochs, run_dir)
        proc = spawn.epochal(*args, **env)
        code, output = spawn.finish(proc, SMALL.deadline)
        runs[device] = read_digits(code, output, run_dir)
    spawn.assert_none_left()
    for verdict in compare_digits(runs["cuda"], runs["cpu"], "cuda", "nccl"):
        assert verdict.passed, verdict.line()
    assert runs["cuda"].placement, "the coordinator said nothing of where the data plane is"
