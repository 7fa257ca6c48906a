"""Fixtures for the GPU checks: the integration tests' ``spawn`` (deadlines, and every process
killed at teardown), and ``cuda_world``: one rank per GPU, or a skip that says there is none."""

from __future__ import annotations

import pytest
import torch

from tests.integration.conftest import spawn  # noqa: F401  (the fixture, shared)

NO_CUDA = (
    "needs a CUDA device (torch.cuda.is_available() is False on this machine): run tests/gpu, "
    "or bench/gpu_check.sh, where there is one"
)


@pytest.fixture
def cuda_world() -> int:
    """How many ranks the GPU checks run: one per GPU."""
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    return torch.cuda.device_count()
