"""The weights' checksum each rank reports: equal for equal weights, different for any bit."""

from __future__ import annotations

import pytest
import torch

from epochal.worker.training.checksums import weights_checksum


def model(seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1)).to(
        dtype
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_equal_weights_give_equal_checksums_and_one_bit_another(dtype: torch.dtype):
    a, b = model(0, dtype), model(0, dtype)
    assert weights_checksum(a) == weights_checksum(b)
    with torch.no_grad():
        flat = b[2].bias.view(torch.int16 if dtype.itemsize == 2 else torch.int32)
        flat[0] ^= 1  # the last bit of one parameter
    assert weights_checksum(a) != weights_checksum(b)
    assert weights_checksum(model(1, dtype)) != weights_checksum(a)


def test_a_wrapper_around_the_same_parameters_gives_the_same_checksum():
    inner = model(0)
    wrapper = torch.nn.ModuleDict({"net": inner})
    assert weights_checksum(wrapper) == weights_checksum(inner)


def test_a_non_contiguous_parameter_is_read_by_its_values():
    a, b = model(0), model(0)
    with torch.no_grad():
        b[0].weight = torch.nn.Parameter(b[0].weight.detach().t().contiguous().t())
    assert not b[0].weight.is_contiguous()
    assert weights_checksum(a) == weights_checksum(b)
