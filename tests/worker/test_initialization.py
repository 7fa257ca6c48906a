"""Initialisation on one rank: every rank gets rank 0's data-dependent parameters, exactly.

Three spawned ranks, each with its own data and its own random model. Rank 0 sets a layer's
weights to the k-means centroids of its data (the seed's example) and a BatchNorm's statistics;
after :func:`initialize_on_rank` every rank holds exactly rank 0's tensors. The seed's trick
(rank 0's loss ``world * ((p - c) ** 2).sum()``, one DDP step of SGD with lr 0.5) reaches the
same parameters up to rounding, and misses them with Adam. ``fit(initialize=...)`` does the same
before it wraps the model, in a mode (fully_sharded) that does not broadcast by itself. A
computation that raises on rank 0 fails every rank instead of leaving them in a broadcast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from epochal.errors import EpochalError
from epochal.worker.session import EpochContext, RunResult
from epochal.worker.training.initialization import buckets, initialize_on_rank
from epochal.worker.training.train import fit
from tests.worker.ranks import RANKS, StandIn, run_ranks, start_rank

# every test here in one test process: the ranks (module-scoped) run once
pytestmark = RANKS

DEADLINE = 90.0
WORLD = 3
K, DIM = 3, 4


def kmeans(x: torch.Tensor, k: int, iterations: int = 10) -> torch.Tensor:
    centroids = x[:k].clone()
    for _ in range(iterations):
        nearest = torch.cdist(x, centroids).argmin(dim=1)
        for j in range(k):
            members = x[nearest == j]
            if len(members):
                centroids[j] = members.mean(dim=0)
    return centroids


def rank_data(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    centres = torch.tensor([[0.0] * DIM, [4.0] * DIM, [-4.0] * DIM])
    return torch.cat([c + torch.randn(20, DIM, generator=g) for c in centres])


def make_model(rank: int) -> nn.Module:
    torch.manual_seed(50 + rank)  # every rank starts elsewhere
    return nn.Sequential(nn.Linear(DIM, K, bias=False), nn.BatchNorm1d(K))


def set_from_data(data: torch.Tensor) -> Any:
    def compute(model: nn.Module) -> None:
        model[0].weight.copy_(kmeans(data, K))
        model[1].running_mean.copy_(torch.arange(K, dtype=torch.float32))

    return compute


class OneEpoch(StandIn):
    """The part of a Session fit needs, without a coordinator: one epoch, no checkpoints."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank, WORLD)

    def run_epochs(self, train_epoch: Any, valid_epoch: Any, **kw: Any) -> RunResult:
        train_epoch(EpochContext(0, 1, 0, 1.0, self.rank, WORLD, self))  # type: ignore[arg-type]
        return RunResult(None, None, 1, self.rank, WORLD, restore_best=False)


def init_rank(rank: int, world: int, store: str, out: str) -> None:
    start_rank(rank, world, store, DEADLINE)
    try:
        data = rank_data(rank)
        result: dict[str, Any] = {"centroids": kmeans(data, K)}

        model = make_model(rank)
        initialize_on_rank(model, set_from_data(data))
        result["broadcast"] = {k: v.clone() for k, v in model.state_dict().items()}

        # the seed's trick: rank 0's loss pulls p to its centroids, the others' losses are zero
        for name, make_opt in (
            ("trick_sgd", lambda ps: torch.optim.SGD(ps, lr=0.5)),
            ("trick_adam", lambda ps: torch.optim.Adam(ps, lr=0.5)),
        ):
            layer = make_model(rank)[0]
            ddp = DistributedDataParallel(layer)
            opt = make_opt(layer.parameters())
            target = kmeans(rank_data(0), K)
            weight = ddp.module.weight
            scale = float(world) if rank == 0 else 0.0
            # the forward runs through DDP so that it all-reduces; the loss reads the weight
            loss = ddp(torch.zeros(1, DIM)).sum() * 0 + scale * ((weight - target) ** 2).sum()
            loss.backward()
            opt.step()
            result[name] = layer.weight.detach().clone()

        # fit(initialize=...) in a mode whose wrapping does not broadcast
        model = make_model(rank)
        fit(
            OneEpoch(rank),  # type: ignore[arg-type]
            model,
            torch.optim.SGD(model.parameters(), lr=0.0),
            [(torch.randn(4, DIM), torch.randn(4, K))],
            None,
            nn.functional.mse_loss,
            mode="fully_sharded",
            initialize=set_from_data(data),
            progress=False,
        )
        result["fit"] = model[0].weight.detach().clone()  # whole again once fit returns

        # a computation that fails on rank 0 fails every rank
        def broken(model: nn.Module) -> None:
            raise RuntimeError("no data on this rank")

        try:
            initialize_on_rank(make_model(rank), broken)
            result["failure"] = None
        except (RuntimeError, EpochalError) as exc:
            result["failure"] = f"{type(exc).__name__}: {exc}"
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("init")
    run_ranks(init_rank, WORLD, tmp, str(tmp), deadline=DEADLINE)
    return [torch.load(tmp / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.slow  # spawned gloo ranks train (the ranks fixture)
def test_every_rank_holds_rank_0s_parameters_and_buffers_exactly(ranks):
    assert not torch.equal(ranks[0]["centroids"], ranks[1]["centroids"])  # the data differ
    for rank in ranks:
        state = rank["broadcast"]
        assert torch.equal(state["0.weight"], ranks[0]["centroids"])
        assert torch.equal(state["1.running_mean"], torch.arange(K, dtype=torch.float32))
        for key, value in ranks[0]["broadcast"].items():
            assert torch.equal(state[key], value), key


@pytest.mark.slow  # spawned gloo ranks train (the ranks fixture)
def test_the_seeds_trick_reaches_the_same_parameters_with_sgd_only(ranks):
    for rank in ranks:
        torch.testing.assert_close(
            rank["trick_sgd"], rank["broadcast"]["0.weight"], rtol=0, atol=1e-6
        )
        assert torch.equal(rank["trick_sgd"], ranks[0]["trick_sgd"])
        # Adam normalises the step: one step of lr 0.5 moves every weight by about 0.5
        assert (rank["trick_adam"] - ranks[0]["centroids"]).abs().max() > 0.1


@pytest.mark.slow  # spawned gloo ranks train (the ranks fixture)
def test_fit_initializes_on_rank_0_before_it_wraps_the_model(ranks):
    for rank in ranks:
        assert torch.equal(rank["fit"], ranks[0]["centroids"])  # lr 0: the step changed nothing


@pytest.mark.slow  # spawned gloo ranks train (the ranks fixture)
def test_a_failure_on_rank_0_reaches_every_rank(ranks):
    assert ranks[0]["failure"] == "RuntimeError: no data on this rank"
    for rank in ranks[1:]:
        assert rank["failure"].startswith("EpochalError: the initialisation on rank 0 raised")


def test_buckets_keep_order_and_split_at_the_cap():
    ts = [torch.zeros(10), torch.zeros(10, dtype=torch.float64), torch.zeros(10), torch.zeros(30)]
    got = buckets(ts, cap_bytes=100)
    assert [[t.numel() for t in b] for b in got] == [[10, 10], [30], [10]]
    assert got[0][0] is ts[0] and got[0][1] is ts[2] and got[2][0] is ts[1]
