"""Gradient clipping and mixed precision in every mode, against the same steps in one process.

One spawned group of CPU ranks per world size runs :func:`epochal.fit` (with a one-epoch
stand-in for the coordinator's session) in every mode with: clipping in float32, bfloat16
autocast, and float16 autocast with its scaler and clipping, where one rank's loss overflows in
the second of three steps. The tests compare each rank's weights with one process that computes
every rank's gradients itself, averages them, unscales, clips and steps with the same seeds and
data. Refusals of bad values run in this process.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import epochal
from epochal.errors import ConfigError
from epochal.worker.checkpoints.checkpoint import Checkpointer
from epochal.worker.session import EpochContext, RunResult
from epochal.worker.strategies import MODES, Strategy, wrap
from epochal.worker.training.initialization import is_dtensor
from epochal.worker.training.precision import PRECISIONS, StepPolicy, check_clip_grad_norm
from epochal.worker.training.train import fit
from tests.worker.ranks import RANKS, StandIn, run_ranks, start_rank

train_module = importlib.import_module("epochal.worker.training.train")
fitting_module = importlib.import_module("epochal.worker.training.fitting")

DEADLINE = 150.0  # seconds for one group of ranks, spawn included

pytestmark = [
    # every test here in one test process: the groups of ranks (module-scoped) run once
    RANKS,
    # the test that starts a group of ranks holds its setup: the group's deadline fails it first
    pytest.mark.timeout(int(DEADLINE) + 60),
]
BATCHES = 6
ACCUMULATE = 2  # three steps of two batches
CLIP = 0.05  # well under the gradients' norm: every step is clipped (checked below)
OVERFLOW_BATCH = 3  # the stepping batch of the second step: the last rank's loss overflows
# (precision, clip_grad_norm, overflow) per case
CASES: dict[str, tuple[str, float | None, bool]] = {
    "clip": ("32", CLIP, False),
    "bf16": ("bf16", None, False),
    "fp16_clip_overflow": ("fp16", CLIP, True),
}


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)  # a different seed per rank: every mode starts from rank 0's
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # plain SGD with momentum: its step is proportional to the (clipped) gradient, so a missing
    # or misplaced clip shows in the weights (Adam would normalise most of it away)
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def make_data(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [
        (torch.randn(4, 6, generator=g), 3 * torch.randn(4, 3, generator=g)) for _ in range(BATCHES)
    ]


def loss_fn(rank: int, world: int, overflow: bool) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    """mse_loss; with ``overflow``, the last rank's loss at OVERFLOW_BATCH is 1e20 times larger:
    its gradient overflows float16 in backward, so the step must be skipped on every rank."""
    calls = [0]

    def loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        value = nn.functional.mse_loss(outputs, targets)
        hit = overflow and rank == world - 1 and calls[0] == OVERFLOW_BATCH
        calls[0] += 1
        return value * 1e20 if hit else value

    return loss


class OneEpoch(StandIn):
    """What fit needs of a Session, without a coordinator: one epoch of every batch, factor 1."""

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
        train_epoch(
            EpochContext(
                epoch=0,
                train_batches=batches(0)[0],
                valid_batches=0,
                lr_factor=1.0,
                rank=self.rank,
                world_size=self.world_size,
                session=self,  # type: ignore[arg-type]
            )
        )
        return RunResult(
            best_epoch=None,
            best_loss=None,
            epochs_run=1,
            rank=self.rank,
            world_size=self.world_size,
        )


def run_case(mode: str, rank: int, world: int, case: str) -> dict[str, Any]:
    precision, clip, overflow = CASES[case]
    model = make_model(10 + rank)
    built: list[Strategy] = []
    real_wrap = fitting_module.wrap

    def keep(*args: Any, **kwargs: Any) -> Strategy:
        built.append(real_wrap(*args, **kwargs))
        return built[-1]

    fitting_module.wrap = keep  # type: ignore[assignment]  # to read the scaler after the run
    try:
        fit(
            OneEpoch(rank, world),  # type: ignore[arg-type]
            model,
            make_optimizer(model),
            make_data(rank),
            None,
            loss_fn(rank, world, overflow),
            accumulate=ACCUMULATE,
            mode=mode,
            progress=False,
            precision=precision,
            clip_grad_norm=clip,
        )
    finally:
        fitting_module.wrap = real_wrap  # type: ignore[assignment]
    scaler = built[0].policy.scaler
    state = model.state_dict()  # whole again after fit, in every mode
    assert not any(is_dtensor(v) for v in state.values())
    return {
        "weights": {k: v.detach().clone() for k, v in state.items()},
        "scale": None if scaler is None else scaler.get_scale(),
    }


def scaler_after_resume(mode: str, rank: int, world: int, directory: Path) -> dict[str, Any]:
    """fp16 through the bare Strategy: a step that overflows on the last rank, a clean one, a
    checkpoint; then a fresh model and strategy load it. Returns both scalers' states."""
    states = []
    for seed in (10, 77):
        model = make_model(seed + rank)
        strategy = wrap(
            model, make_optimizer(model), torch.device("cpu"), mode=mode, precision="fp16"
        )
        checkpointer = Checkpointer(directory, rank=rank, run_id="t")
        if seed == 77:
            checkpointer.load(0, strategy.state, rng=False)
        else:
            x, y = make_data(rank)[0]
            for factor in (1e20 if rank == world - 1 else 1.0, 1.0):
                strategy.zero_grad()
                with strategy.policy.autocast():
                    loss = nn.functional.mse_loss(strategy.module(x), y) * factor
                strategy.policy.backward(loss)
                strategy.step()
            checkpointer.save(0, strategy.state)
        assert strategy.policy.scaler is not None
        states.append(strategy.policy.scaler.state_dict())
    return {"trained": states[0], "resumed": states[1]}


def policy_rank(rank: int, world: int, store: str, out: str) -> None:
    start_rank(rank, world, store, DEADLINE)
    try:
        results: dict[Any, Any] = {
            (m, c): run_case(m, rank, world, c) for m in MODES for c in CASES
        }
        for m in MODES:
            results[(m, "scaler")] = scaler_after_resume(m, rank, world, Path(out) / f"ck-{m}")
    finally:
        dist.destroy_process_group()
    torch.save(results, Path(out) / f"rank{rank}.pt")


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"{w}ranks")
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    world = request.param
    tmp = tmp_path_factory.mktemp(f"precision{world}")
    run_ranks(policy_rank, world, tmp, str(tmp), deadline=DEADLINE)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


# ---------------------------------------------------------------- the reference, in one process


def one_process(world: int, case: str, *, clip_override: float | None = -1.0) -> dict[str, Any]:
    """The steps of ``case`` done by hand: rank 0's model, every rank's batches through a copy
    of it under the case's autocast (float16: the loss scaled by 2**16), gradients averaged,
    unscaled and checked for inf (a step with one is skipped), clipped, then SGD steps."""
    precision, clip, overflow = CASES[case]
    if clip_override != -1.0:
        clip = clip_override
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scale = 2.0**16 if precision == "fp16" else 1.0
    model = make_model(10)
    optimizer = make_optimizer(model)
    data = [make_data(r) for r in range(world)]
    losses = [loss_fn(r, world, overflow) for r in range(world)]
    norms, skipped = [], []
    for start in range(0, BATCHES, ACCUMULATE):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for r in range(world):
            replica = copy.deepcopy(model)
            for x, y in data[r][start : start + ACCUMULATE]:
                with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                    loss = losses[r](replica(x), y)
                (loss / ACCUMULATE * scale).backward()  # type: ignore[no-untyped-call]
            for g, p in zip(grads, replica.parameters(), strict=True):
                assert p.grad is not None
                g += p.grad / world
        grads = [g / scale for g in grads]
        if not all(torch.isfinite(g).all() for g in grads):
            skipped.append(start // ACCUMULATE)
            scale /= 2
            continue
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
    return {
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "norms": norms,
        "skipped": skipped,
        "scale": scale,
    }


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=k)


def differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# ---------------------------------------------------------------- the tests

# float32 sums of the ranks' gradients in another order than one process (DDP's ring, ZeRO's
# broadcast, FSDP2's reduce-scatter): equal to float32 rounding after three steps, as the modes'
# own test holds them
FP32_TOL = 1e-5


@pytest.mark.slow  # spawned gloo ranks train (the ranks fixture)
@pytest.mark.parametrize("mode", MODES)
def test_clipping_reaches_the_weights_of_one_process_clipping_the_averaged_gradients(ranks, mode):
    world = len(ranks)
    ref = one_process(world, "clip")
    assert len(ref["norms"]) == BATCHES // ACCUMULATE
    assert min(ref["norms"]) > 4 * CLIP  # every step was clipped, hard
    unclipped = one_process(world, "clip", clip_override=None)
    assert differ(unclipped["weights"], ref["weights"]) > 100 * FP32_TOL  # clipping shows
    for rank in ranks:  # every rank: the same weights as the reference
        close(rank[(mode, "clip")]["weights"], ref["weights"], FP32_TOL)


# a half-precision forward of the same float32 weights on the same batch is the same computation
# in both runs, so what differs is again only the order of the float32 sums (measured: at most
# 5e-8 with three ranks, bit-identical with two); the bound leaves room for one such rounding
# difference to flip a bfloat16 rounding of a weight (2**-8 relative) in one step
HALF_TOL = 1e-4


@pytest.mark.slow  # spawned gloo ranks train (the ranks fixture)
@pytest.mark.parametrize("mode", MODES)
def test_bf16_autocast_reaches_the_weights_of_one_process_under_the_same_autocast(ranks, mode):
    world = len(ranks)
    ref = one_process(world, "bf16")
    fp32 = one_process(world, "clip", clip_override=None)
    assert differ(fp32["weights"], ref["weights"]) > 10 * HALF_TOL  # bfloat16 really ran
    for rank in ranks:
        close(rank[(mode, "bf16")]["weights"], ref["weights"], HALF_TOL)


@pytest.mark.slow  # spawned gloo ranks train (the ranks fixture)
@pytest.mark.parametrize("mode", MODES)
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank_and_clips_unscaled(ranks, mode):
    world = len(ranks)
    ref = one_process(world, "fp16_clip_overflow")
    assert ref["skipped"] == [OVERFLOW_BATCH // ACCUMULATE] and ref["scale"] == 2.0**15
    assert min(ref["norms"]) > 4 * CLIP
    for rank in ranks:
        got = rank[(mode, "fp16_clip_overflow")]
        assert got["scale"] == ref["scale"]  # every rank lowered the scale, main's too
        # scaling and unscaling multiply by powers of two: exact, so the bf16 case's bound holds
        close(got["weights"], ref["weights"], HALF_TOL)


@pytest.mark.slow  # spawned gloo ranks train (the ranks fixture)
@pytest.mark.parametrize("mode", MODES)
def test_fp16_checkpoint_holds_the_loss_scale_every_rank_shares(ranks, mode):
    for rank in ranks:
        got = rank[(mode, "scaler")]
        # one overflow (scale halved, count reset), then one clean step counted
        assert got["trained"]["scale"] == 2.0**15 and got["trained"]["_growth_tracker"] == 1
        assert got["resumed"] == got["trained"]  # not the initial 2**16 and 0


# ---------------------------------------------------------------- refusals, in this process


@pytest.mark.parametrize("value", [0, -1.0, 0.0, float("nan"), float("inf"), True, "1.0"])
def test_bad_clip_grad_norm_is_refused_naming_the_value(value):
    with pytest.raises(ConfigError, match="clip_grad_norm must be a finite number > 0") as exc:
        check_clip_grad_norm(value)
    assert repr(value) in str(exc.value)


@pytest.mark.parametrize("value", ["16", "fp32", "bf16-mixed", 32, None])
def test_unknown_precision_is_refused_with_the_accepted_ones(value):
    with pytest.raises(ConfigError) as exc:
        StepPolicy(value)  # type: ignore[arg-type]
    assert str(exc.value) == (
        f"unknown precision {value!r}: pick one of '32', 'bf16', 'fp16' (strings)"
    )
    assert PRECISIONS == ("32", "bf16", "fp16")


def test_train_refuses_bad_values_before_joining(monkeypatch):
    def no_join(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("train joined the run with a bad option")

    monkeypatch.setattr(train_module, "join", no_join)
    model = nn.Linear(2, 1)
    args = (model, torch.optim.SGD(model.parameters(), lr=0.1), [], None, nn.functional.mse_loss)
    with pytest.raises(ConfigError, match=r"got 0$"):
        epochal.train(*args, clip_grad_norm=0)
    with pytest.raises(ConfigError, match="unknown precision 'fp8'"):
        epochal.train(*args, precision="fp8")


def test_wrap_refuses_bad_values_before_needing_a_process_group():
    m = nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match=r"got -0\.5$"):
        wrap(m, opt, torch.device("cpu"), clip_grad_norm=-0.5)
    with pytest.raises(ConfigError, match="unknown precision 'half'"):
        wrap(m, opt, torch.device("cpu"), precision="half")


def test_the_default_policy_adds_nothing():
    policy = StepPolicy()
    assert policy.scaler is None and policy.clip_grad_norm is None
    with policy.autocast():
        assert not torch.is_autocast_enabled("cpu")
    assert StepPolicy("bf16").scaler is None  # bfloat16 has float32's range: no scaler
    fp16 = StepPolicy("fp16", 1.0, "cpu")
    assert isinstance(fp16.scaler, torch.amp.GradScaler) and fp16.scaler.is_enabled()
    with fp16.autocast():
        assert torch.get_autocast_dtype("cpu") == torch.float16
