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


@pytest.mark.parametrize("index", [0, 1, 5, 31])
def test_one_bit_in_the_words_of_a_weight_changes_the_checksum(index: int):
    """Bits summed as 64-bit words (the 8 x 4 weight), not only the bytes left over."""
    a, b = model(0), model(0)
    with torch.no_grad():
        b[0].weight.view(-1).view(torch.int32)[index] ^= 1 << 30
    assert weights_checksum(a) != weights_checksum(b)


def test_a_parameter_at_an_odd_offset_of_a_flat_buffer_is_read_by_its_values():
    """A parameter that is a view into one buffer, 4 bytes past a word: read alike."""
    a, b = model(0), model(0)
    flat = torch.zeros(1 + sum(p.numel() for p in b.parameters()))
    at = 1
    with torch.no_grad():
        for module in (b[0], b[2]):
            for name, param in list(module.named_parameters()):
                view = flat[at : at + param.numel()].view_as(param)
                view.copy_(param)
                setattr(module, name, torch.nn.Parameter(view))
                at += param.numel()
    assert b[0].weight.storage_offset() == 1
    assert weights_checksum(a) == weights_checksum(b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_numpy_and_torch_sum_alike(dtype: torch.dtype):
    """The host's sums (numpy) and a device's (torch) give one checksum: ranks agree whichever
    way they sum, and a sum that wraps past 64 bits wraps alike."""
    a = model(0, dtype)
    with torch.no_grad():
        a[0].weight.view(-1).view(torch.int32)[:16] = 2**31 - 1  # sums past int64: wrapping
    assert weights_checksum(a, host=True) == weights_checksum(a, host=False)


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
