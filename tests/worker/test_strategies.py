"""Optimization modes on 2 and 3 CPU workers: same weights as replicated, resume, state per rank.

One spawned group of ranks per world size runs every mode twice: through :func:`epochal.fit`
(with a local stand-in for the coordinator's session: two epochs, accumulation, a learning-rate
factor, real checkpoints, the best epoch restored, then a resumed run on a fresh model) and
through the bare :class:`Strategy` (steps with ``no_sync`` accumulation, optimizer-state bytes).
The tests then read what each rank wrote. Each group runs under a deadline and is killed past it.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from epochal.errors import ConfigError
from epochal.worker.strategies import MODES, ModeOptions, mode_options, wrap
from epochal.worker.training.initialization import is_dtensor
from epochal.worker.training.train import fit
from tests.worker.elastic import make_model, make_optimizer
from tests.worker.ranks import RANKS, LocalSession, full_state, run_ranks, start_rank

DEADLINE = 150.0  # seconds for one group of ranks, spawn included

pytestmark = [
    # every test here in one test process: the groups of ranks (module-scoped) run once
    RANKS,
    # the test that starts a group of ranks holds its setup: the group's deadline fails it first
    pytest.mark.timeout(int(DEADLINE) + 60),
]
BATCHES = 6
ACCUMULATE = 2


# ---------------------------------------------------------------- running ranks


# ---------------------------------------------------------------- what each rank runs


def make_data(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [
        (torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(BATCHES)
    ]


def fit_twice(
    mode: str, rank: int, world: int, directory: Path, kept: list[nn.Module]
) -> dict[str, Any]:
    """A two-epoch run, then a run resumed after epoch 0 on a fresh model; the first model is
    appended to ``kept``."""
    out: dict[str, Any] = {}
    for name, resume, seed in (("run", None, 10 + rank), ("resumed", 0, 77 + rank)):
        model = make_model(seed, dropout=False)
        holder = [model]
        session = LocalSession(rank, world, directory, resume, holder)
        fit(
            session,  # type: ignore[arg-type]
            model,
            make_optimizer(model),
            make_data(rank),
            None,
            nn.functional.mse_loss,
            accumulate=ACCUMULATE,
            mode=mode,
            progress=False,
        )
        out[f"{name}_last"] = session.last  # after epoch 1
        if name == "run":  # what the model holds once fit returned, read without a collective
            state = model.state_dict()
            out["sharded_after_fit"] = [k for k, v in state.items() if is_dtensor(v)]
            out["classes_after_fit"] = sorted({type(m).__name__ for m in model.modules()})
            out["state_after_fit"] = {k: v.detach().clone() for k, v in state.items()}
            kept.append(model)
        out[f"{name}_best"] = full_state(model)  # epoch 0's weights, restored by fit
    return out


def bare_strategy(mode: str, rank: int) -> dict[str, Any]:
    """Steps through the Strategy API (accumulating under no_sync) and the state it holds."""
    model = make_model(10 + rank, dropout=False)
    strategy = wrap(model, make_optimizer(model), torch.device("cpu"), mode=mode)
    strategy.module.train()
    data = make_data(rank)
    for start in range(0, BATCHES, ACCUMULATE):
        strategy.zero_grad()
        for i in range(start, start + ACCUMULATE):
            x, y = data[i]
            last = i == start + ACCUMULATE - 1
            with strategy.no_sync() if not last else torch.enable_grad():
                loss = nn.functional.mse_loss(strategy.module(x), y) / ACCUMULATE
                loss.backward()  # type: ignore[no-untyped-call]
        strategy.step()
    n_params = sum(1 for _ in model.parameters())
    layout = strategy.layout
    return {
        "layout": (layout.rank, layout.world_size, layout.root, layout.device),
        "weights": full_state(strategy.model),
        "state_bytes": strategy.optimizer_state_bytes(),
        "n_params": n_params,
    }


def modes_rank(rank: int, world: int, store: str, out: str) -> None:
    start_rank(rank, world, store, DEADLINE)
    try:
        results = {}
        kept: list[nn.Module] = []
        for mode in MODES:
            results[mode] = {
                **fit_twice(mode, rank, world, Path(out) / f"ck-{mode}", kept),
                **bare_strategy(mode, rank),
            }
    finally:
        dist.destroy_process_group()
    probe = make_data(0)[0][0]
    for mode, model in zip(MODES, kept, strict=True):  # usable without the process group
        model.eval()
        with torch.no_grad():
            results[mode]["output_without_group"] = model(probe)
    torch.save(results, Path(out) / f"rank{rank}.pt")


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"{w}ranks")
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    world = request.param
    tmp = tmp_path_factory.mktemp(f"modes{world}")
    run_ranks(modes_rank, world, tmp, str(tmp), deadline=DEADLINE)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], exact: bool = False) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


# ---------------------------------------------------------------- the tests


def params_only(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if "running" not in k and "num_batches" not in k}


def one_process_replicated(world: int) -> dict[str, torch.Tensor]:
    """What ``bare_strategy`` computes in mode replicated, in one process without DDP: each step,
    every rank's copy of rank 0's model accumulates its own batches' gradients (BatchNorm on its
    own batch statistics), their average is applied, and the running statistics are rank 0's."""
    model = make_model(10, dropout=False)
    optimizer = make_optimizer(model)
    data = [make_data(r) for r in range(world)]
    replicas = [copy.deepcopy(model) for _ in range(world)]
    for start in range(0, BATCHES, ACCUMULATE):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for r, replica in enumerate(replicas):
            replica.load_state_dict(model.state_dict())
            replica.zero_grad(set_to_none=True)
            for x, y in data[r][start : start + ACCUMULATE]:
                loss = nn.functional.mse_loss(replica(x), y) / ACCUMULATE
                loss.backward()  # type: ignore[no-untyped-call]
            for g, p in zip(grads, replica.parameters(), strict=True):
                g += p.grad / world
        with torch.no_grad():
            for b, b0 in zip(model.buffers(), replicas[0].buffers(), strict=True):
                b.copy_(b0)
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow  # spawned gloo ranks train (the ranks fixture)
def test_replicated_reaches_the_weights_of_averaged_gradients_in_one_process(ranks):
    close(ranks[0]["replicated"]["weights"], one_process_replicated(len(ranks)))
    for other in ranks[1:]:  # every rank holds the same parameters
        for key in ("run_last", "weights"):
            close(
                params_only(other["replicated"][key]),
                params_only(ranks[0]["replicated"][key]),
                exact=True,
            )


@pytest.mark.slow  # spawned gloo ranks train (the ranks fixture)
@pytest.mark.parametrize("mode", [m for m in MODES if m != "replicated"])
def test_every_mode_reaches_the_weights_of_replicated(ranks, mode):
    rank0, ref = ranks[0][mode], ranks[0]["replicated"]
    for key in ("run_last", "run_best", "weights"):
        close(rank0[key], ref[key])  # parameters and rank 0's BatchNorm statistics
    for other in ranks[1:]:  # every rank holds the same parameters
        close(params_only(other[mode]["run_last"]), params_only(rank0["run_last"]), exact=True)
        close(params_only(other[mode]["weights"]), params_only(rank0["weights"]), exact=True)


@pytest.mark.slow  # spawned gloo ranks train (the ranks fixture)
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_resumes_to_the_weights_of_the_uninterrupted_run(ranks, mode):
    # DDP rebuilds its buckets after the first step, so a fresh DDP sums the 3-rank ring
    # all-reduce in another order than the uninterrupted run: equal up to rounding there
    exact = len(ranks) == 2 or mode in ("main", "fully_sharded")
    for i, rank in enumerate(ranks):
        # BatchNorm statistics: DDP broadcasts rank 0's before each forward, so the other ranks'
        # are rank 0's plus one batch of their own, and a checkpoint holds one rank's copy
        keep = (lambda s: s) if i == 0 else params_only
        close(keep(rank[mode]["resumed_last"]), keep(rank[mode]["run_last"]), exact)
        # the best epoch ran before the restart: fit restores it from its checkpoint
        close(keep(rank[mode]["resumed_best"]), keep(rank[mode]["run_best"]), exact)


@pytest.mark.slow  # spawned gloo ranks train (the ranks fixture)
def test_fully_sharded_leaves_the_whole_model_in_plain_tensors(ranks):
    ref = ranks[0]["replicated"]
    for rank in ranks:
        fully = rank["fully_sharded"]
        assert fully["sharded_after_fit"] == [], "DTensor shards left in the model after fit"
        assert fully["classes_after_fit"] == ref["classes_after_fit"]  # no FSDP<...> classes left
        state = params_only(fully["state_after_fit"])
        close(state, params_only(ranks[0]["fully_sharded"]["state_after_fit"]), exact=True)
        close(state, params_only(ref["state_after_fit"]))
        close(params_only(state), params_only(fully["run_best"]), exact=True)
        torch.testing.assert_close(
            fully["output_without_group"], ranks[0]["fully_sharded"]["output_without_group"]
        )


@pytest.mark.slow  # spawned gloo ranks train (the ranks fixture)
def test_every_mode_is_built_from_its_rank_s_place_in_the_world(ranks):
    for i, rank in enumerate(ranks):
        for mode in MODES:
            assert rank[mode]["layout"] == (i, len(ranks), 0, torch.device("cpu")), mode


@pytest.mark.slow  # spawned gloo ranks train (the ranks fixture)
def test_optimizer_state_per_rank(ranks):
    world = len(ranks)
    full = [r["replicated"]["state_bytes"] for r in ranks]
    assert len(set(full)) == 1 and full[0] > 0  # replicated: every rank holds all of it
    step_bytes = ranks[0]["replicated"]["n_params"] * 4  # AdamW's per-parameter step counter
    main = [r["main"]["state_bytes"] for r in ranks]
    assert main == [full[0]] + [0] * (world - 1)  # main: rank 0 alone
    sharded = [r["sharded"]["state_bytes"] for r in ranks]
    assert sum(sharded) == full[0] and max(sharded) < full[0]  # ZeRO: each parameter's once
    fully = [r["fully_sharded"]["state_bytes"] for r in ranks]
    # FSDP2: every rank holds its rows of each moment (and its own step counters)
    assert sum(fully) == full[0] + (world - 1) * step_bytes
    assert max(fully) < full[0] / world + 2 * step_bytes + 16 * 4 * 2


# ---------------------------------------------------------------- refusals, in this process


def test_options_are_checked_before_anything_runs():
    with pytest.raises(ConfigError, match="unknown mode 'zero'"):
        wrap(
            nn.Linear(2, 2),
            torch.optim.SGD(nn.Linear(2, 2).parameters()),
            torch.device("cpu"),
            mode="zero",
        )
    with pytest.raises(ConfigError, match="unknown mode option"):
        mode_options({"bucket_mb": 3})
    with pytest.raises(ConfigError, match="bucket_cap_mb must be > 0"):
        ModeOptions(bucket_cap_mb=0)
    m = nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match="reshard_after_forward has no meaning in mode 'main'"):
        wrap(m, opt, cpu, mode="main", options={"reshard_after_forward": False})
    with pytest.raises(ConfigError, match="bucket_cap_mb has no meaning in mode 'fully_sharded'"):
        wrap(m, opt, cpu, mode="fully_sharded", options=ModeOptions(bucket_cap_mb=5))
    with pytest.raises(ConfigError, match="takes no DDP options"):
        wrap(m, opt, cpu, mode="main", ddp_options={"broadcast_buffers": False})
    with pytest.raises(ConfigError, match="not in ddp_options as well"):
        wrap(m, opt, cpu, options={"bucket_cap_mb": 2}, ddp_options={"bucket_cap_mb": 1})


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "s"), 1), rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_sync_batchnorm_and_foreign_optimizers_are_refused_clearly(one_rank):
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    with pytest.raises(ConfigError, match="sync_batchnorm needs CUDA devices"):
        wrap(
            m,
            torch.optim.SGD(m.parameters(), lr=0.1),
            torch.device("cpu"),
            options={"sync_batchnorm": True},
        )
    with pytest.raises(ConfigError, match="the optimizer holds 2 parameter"):
        wrap(
            m,
            torch.optim.SGD(nn.Linear(3, 4).parameters(), lr=0.1),
            torch.device("cpu"),
            mode="main",
        )


def test_ddp_options_reach_ddp(one_rank):
    m = nn.Linear(3, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for mode in ("replicated", "sharded"):
        s = wrap(
            m,
            opt,
            torch.device("cpu"),
            mode=mode,
            options={"bucket_cap_mb": 1.5, "find_unused_parameters": True},
        )
        assert s.ddp is not None and s.ddp.find_unused_parameters
        assert s.ddp.bucket_bytes_cap == int(1.5 * 1024 * 1024)
    s = wrap(
        m,
        opt,
        torch.device("cpu"),
        ddp_options={"bucket_cap_mb": 100, "gradient_as_bucket_view": True},
    )
    assert s.ddp is not None and s.ddp.bucket_bytes_cap == 100 * 1024 * 1024
    assert s.ddp.gradient_as_bucket_view


class TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(3, 1), nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_main_leaves_parameters_no_rank_used_without_gradient(one_rank):
    model = TwoBranches()
    before = model.unused.weight.detach().clone()
    s = wrap(
        model,
        torch.optim.Adam(model.parameters(), lr=0.1),
        torch.device("cpu"),
        mode="main",
        options={"find_unused_parameters": True, "bucket_cap_mb": 1e-5},  # a bucket per tensor
    )
    s.zero_grad()
    s.module(torch.randn(4, 3)).sum().backward()
    s.step()
    assert model.unused.weight.grad is None and model.used.weight.grad is not None
    assert torch.equal(model.unused.weight, before)  # Adam skipped it: no state, no step
    assert model.unused.weight not in s.optimizer.state
