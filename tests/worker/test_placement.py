"""Layer placement: planned splits, the forward over placed layers, refusals, and DDP on top.

This machine has only the CPU, so the layers' devices are all ``cpu`` where tensors must
compute; the planners are checked with CUDA device names (planning touches no device), and the
activations' moves with the meta device, which computes shapes only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from epochal.errors import ConfigError
from epochal.worker.strategies import wrap
from epochal.worker.training.placement import LayeredModel, even_split, memory_split
from tests.worker.ranks import RANKS, run_ranks, start_rank

DEADLINE = 90.0
CUDA = [torch.device("cuda", i) for i in range(3)]  # names only: nothing is allocated on them


def counts(placement: tuple[torch.device, ...]) -> list[int]:
    return [sum(1 for d in placement if d == c) for c in CUDA]


@pytest.mark.parametrize(
    ("layers", "devices", "expected"),
    [(5, 2, [3, 2, 0]), (6, 3, [2, 2, 2]), (2, 3, [1, 1, 0]), (1, 1, [1, 0, 0])],
)
def test_even_split_gives_consecutive_layers_in_equal_numbers(layers, devices, expected):
    placement = even_split(layers, CUDA[:devices])
    assert counts(placement) == expected
    assert list(placement) == sorted(placement, key=lambda d: d.index)  # consecutive, in order


@pytest.mark.parametrize(
    ("sizes", "free", "expected"),
    [
        ([10] * 4, [3, 1], [3, 1, 0]),  # a device with 3x the free memory takes 3x the bytes
        ([10] * 4, [1, 1], [2, 2, 0]),
        ([100, 1, 1, 1], [1, 1], [1, 3, 0]),  # by bytes, not by layer count
        ([10] * 6, [2, 1, 3], [2, 1, 3]),
        ([10] * 4, [0, 5, 5], [0, 2, 2]),  # no free memory: no layers
    ],
)
def test_memory_split_weights_each_device_by_its_free_memory(sizes, free, expected):
    placement = memory_split(sizes, CUDA[: len(free)], [f * 1000 for f in free])
    assert counts(placement) == expected
    assert list(placement) == sorted(placement, key=lambda d: d.index)


def test_impossible_splits_are_refused():
    with pytest.raises(ConfigError, match="cannot place 0 layer"):
        even_split(0, CUDA)
    with pytest.raises(ConfigError, match="the layers take 300 bytes but the devices have 200"):
        memory_split([100, 100, 100], CUDA[:2], [100, 100])
    with pytest.raises(ConfigError, match="give one number >= 0 per device"):
        memory_split([1], CUDA[:2], [100])


def factories() -> tuple[nn.Module, list[nn.Module], nn.Module]:
    return nn.Linear(5, 8), [nn.Tanh(), nn.Linear(8, 8), nn.Tanh()], nn.Linear(8, 2)


def layer_makers():
    return (
        lambda: nn.Linear(5, 8),
        [nn.Tanh, lambda: nn.Linear(8, 8), nn.Tanh],
        lambda: nn.Linear(8, 2),
    )


@pytest.mark.parametrize("split", ["even", "memory"])
def test_forward_and_gradients_equal_the_plain_model(split):
    first, hidden, last = layer_makers()
    torch.manual_seed(0)
    plain = nn.Sequential(first(), *(h() for h in hidden), last())
    torch.manual_seed(0)
    layered = LayeredModel.build(
        first, hidden, last, devices=["cpu", "cpu"], split=split, free_bytes=[10**9, 10**9]
    )
    assert layered.placement == (torch.device("cpu"),) * 5
    x = torch.randn(7, 5)
    out_plain, out_layered = plain(x), layered(x)
    assert torch.equal(out_plain, out_layered)
    out_plain.square().sum().backward()
    out_layered.square().sum().backward()
    plain_grads = [p.grad for p in plain.parameters()]
    layered_grads = [p.grad for p in layered.parameters()]
    assert len(layered_grads) == 6 and all(
        g is not None and g.abs().sum() > 0 for g in layered_grads
    )
    for a, b in zip(plain_grads, layered_grads, strict=True):
        assert torch.equal(a, b)


def test_activations_move_to_each_layers_device():
    seen: list[torch.device] = []
    first, last = nn.Linear(4, 6), nn.Linear(6, 2)
    with torch.device("meta"):
        middle = nn.Linear(6, 6)
        last = nn.Linear(6, 2)
    model = LayeredModel(first, [middle], last, ["cpu", "meta", "meta"])
    for layer in model.layers():
        layer.register_forward_pre_hook(lambda _m, args: seen.append(args[0].device))
    out = model(torch.randn(3, 4))
    assert seen == [torch.device("cpu"), torch.device("meta"), torch.device("meta")]
    assert out.device.type == "meta" and out.shape == (3, 2)
    cpu_out = LayeredModel(nn.Linear(4, 2), [], nn.Identity(), ["cpu", "cpu"], output_device="meta")
    assert cpu_out(torch.randn(3, 4)).device.type == "meta"  # moved to where the targets are


def test_wrong_placements_are_refused_naming_the_layer():
    first, hidden, last = factories()
    with pytest.raises(
        ConfigError, match=r"gives 3 device\(s\) for 5 layers .*no device for hidden.2, output"
    ):
        LayeredModel(first, hidden, last, ["cpu"] * 3)
    with pytest.raises(ConfigError, match=r"no device for hidden\.1; no layer named hidden\.7"):
        LayeredModel(
            first,
            hidden,
            last,
            {
                "input": "cpu",
                "hidden.0": "cpu",
                "hidden.2": "cpu",
                "output": "cpu",
                "hidden.7": "cpu",
            },
        )
    with torch.device("meta"):
        on_meta = nn.Linear(8, 8)
    with pytest.raises(
        ConfigError, match=r"layer .hidden\.1. is placed on cpu but its .weight. was built on meta"
    ):
        LayeredModel(first, [nn.Tanh(), on_meta, nn.Tanh()], last, ["cpu"] * 5)
    with pytest.raises(ConfigError, match="unknown split 'fast'"):
        LayeredModel.build(*layer_makers(), devices=["cpu"], split="fast")


def test_a_model_over_several_devices_is_not_fully_sharded():
    with torch.device("meta"):
        last = nn.Linear(6, 2)
    model = LayeredModel(nn.Linear(4, 6), [], last, ["cpu", "meta"])
    with pytest.raises(ConfigError, match="cannot be fully sharded"):
        wrap(model, torch.optim.SGD(model.parameters()), torch.device("cpu"), mode="fully_sharded")


# ---------------------------------------------------------------- with data parallelism


def placed_rank(rank: int, world: int, store: str, out: str) -> None:
    start_rank(rank, world, store, DEADLINE)
    try:
        g = torch.Generator().manual_seed(rank)
        data = [(torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g)) for _ in range(4)]
        results = {}
        for mode in ("replicated", "main"):
            for kind in ("plain", "layered"):
                first, hidden, last = layer_makers()
                torch.manual_seed(100 + rank)
                if kind == "plain":
                    model: nn.Module = nn.Sequential(first(), *(h() for h in hidden), last())
                else:
                    model = LayeredModel.build(first, hidden, last, devices=["cpu", "cpu"])
                strategy = wrap(
                    model,
                    torch.optim.Adam(model.parameters(), lr=0.05),
                    torch.device("cpu"),
                    mode=mode,
                )
                for x, y in data:
                    strategy.zero_grad()
                    nn.functional.mse_loss(strategy.module(x), y).backward()
                    strategy.step()
                results[mode, kind] = [p.detach().clone() for p in model.parameters()]
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned gloo ranks train
@RANKS
def test_a_layered_model_trains_data_parallel_like_the_plain_model(tmp_path):
    world = 2
    run_ranks(placed_rank, world, tmp_path, str(tmp_path), deadline=DEADLINE)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for mode in ("replicated", "main"):
        for rank in ranks:
            for a, b in zip(rank[mode, "plain"], rank[mode, "layered"], strict=True):
                assert torch.equal(a, b), mode
            for a, b in zip(rank[mode, "layered"], ranks[0][mode, "layered"], strict=True):
                assert torch.equal(a, b), mode
