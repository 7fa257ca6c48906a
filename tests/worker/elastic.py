"""Ranks that lose a peer, leave their process group and meet again in another: what the regroup
tests (``test_regroup_*.py``) share.

- :func:`spawn` runs one function in N spawned processes under a deadline, expecting some of
  them to die by SIGKILL (the lost ranks) and every other one to end well;
- :func:`form_group` is one generation's process group, formed as a worker forms it: rank 0
  opens epochal's data-plane store, the others learn its port (here from a file in the test's
  directory, where the coordinator would send it) and connect;
- a small model with BatchNorm and Dropout, its data sharded by (rank, world size) per epoch, and
  one epoch of training through the Strategy API, with a rank that can be made to die in the
  middle of a collective.
"""

from __future__ import annotations

import copy
import faulthandler
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from epochal.worker.checkpoints.checkpoint import rng_state
from epochal.worker.dataplane.store import StoreServer, connect_store, scoped
from epochal.worker.strategies import Strategy
from epochal.worker.training.initialization import is_dtensor
from tests.worker.ranks import rank_context

COLLECTIVE_TIMEOUT = 60.0
"""Seconds: every process group's collective timeout, and how long a rank waits for a store or
for the next group's port. A survivor that was not told of the loss by a closed socket would
raise only after this (its error then says it timed out, which the tests refuse)."""

SAMPLES = 96
BATCH = 4
CPU = torch.device("cpu")


# ---------------------------------------------------------------- processes


def _entry(fn: Callable[..., None], index: int, tmp: str, deadline: float, args: Any) -> None:
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(max(1.0, deadline - 10), exit=True)  # a hang: its stacks
    try:
        fn(index, Path(tmp), *args)
    except BaseException:
        (Path(tmp) / f"error-{index}.txt").write_text(traceback.format_exc())
        raise


def spawn(
    fn: Callable[..., None],
    processes: int,
    tmp: Path,
    *args: Any,
    deadline: float,
    killed: frozenset[int] = frozenset(),
) -> None:
    """Run ``fn(index, tmp, *args)`` in ``processes`` processes (forked from the server
    :func:`tests.worker.ranks.rank_context` keeps); fail the test unless
    those in ``killed`` end by SIGKILL and every other one ends with status 0, all within
    ``deadline`` seconds (past it every process is killed; each one left dumped its stacks)."""
    ctx = rank_context()
    procs = [
        ctx.Process(target=_entry, args=(fn, i, str(tmp), deadline, args), daemon=True)
        for i in range(processes)
    ]
    for proc in procs:
        proc.start()
    end = time.monotonic() + deadline
    try:
        for proc in procs:
            proc.join(max(0.0, end - time.monotonic()))
    finally:
        late = [i for i, proc in enumerate(procs) if proc.is_alive()]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
    errors = "".join(
        f"\n--- process {i} ---\n{(tmp / f'error-{i}.txt').read_text()}"
        for i in range(processes)
        if (tmp / f"error-{i}.txt").exists()
    )
    if late:
        pytest.fail(f"process(es) {late} still running after {deadline:g} s (stacks above){errors}")
    expected = {i: -signal.SIGKILL if i in killed else 0 for i in range(processes)}
    got = {i: proc.exitcode for i, proc in enumerate(procs)}
    assert got == expected, f"exit statuses {got}, expected {expected}{errors}"


def die_now(note: Path | None = None) -> None:
    """This process ends as a lost worker does: SIGKILL, no cleanup, its sockets closed by the
    kernel. ``note``: a file that gets the instant (``time.monotonic()``, one clock for every
    process of the machine) first."""
    if note is not None:
        note.write_text(repr(time.monotonic()))
    os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------- process groups


_HELD: list[Any] = []
"""Every generation's store client (and on its rank 0 the server), held for the life of the
process as a worker's session holds its own: rank 0 can be done with ``init_process_group``
while its peers still read the store, and a server collected then resets their connections."""


def form_group(
    tmp: Path, generation: int, rank: int, world: int, *, wait: float = COLLECTIVE_TIMEOUT
) -> None:
    """The default process group of ``generation``, ``world`` ranks, on a new data-plane store
    that this generation's rank 0 opens (a process of its own, as in a run). The others wait up
    to ``wait`` seconds for it: a newcomer, standing by while the others train, waits longer."""
    published = tmp / f"generation-{generation}.port"
    if rank == 0:
        server = StoreServer.start("127.0.0.1", COLLECTIVE_TIMEOUT)
        _HELD.append(server)
        store = server.connect(COLLECTIVE_TIMEOUT)
        staged = published.with_suffix(".staged")
        staged.write_text(str(server.port))
        os.replace(staged, published)  # readers see the whole port or nothing
    else:
        end = time.monotonic() + wait
        while not published.exists():  # the coordinator's StoreReady/Welcome, in a test
            if time.monotonic() > end:
                raise TimeoutError(f"generation {generation}'s store never opened")
            time.sleep(0.02)
        store = connect_store("127.0.0.1", int(published.read_text()), COLLECTIVE_TIMEOUT)
    _HELD.append(store)
    dist.init_process_group(
        "gloo",
        store=scoped(store, "test", f"generation-{generation}"),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT),
    )


# ---------------------------------------------------------------- model, data, epoch


def make_model(seed: int, *, dropout: bool = True) -> nn.Module:
    """A small model with BatchNorm's buffers, and a dropout unless ``dropout`` is False."""
    torch.manual_seed(seed)  # each process its own seed: every rank must end with rank 0's
    layers: list[nn.Module] = [
        nn.Linear(6, 16, bias=False),  # a bias before BatchNorm gets only rounding noise
        nn.BatchNorm1d(16),
        nn.Tanh(),
    ]
    if dropout:
        layers.append(nn.Dropout(0.25))  # draws from the generator: a restore must set it back too
    return nn.Sequential(*layers, nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.AdamW(
        [{"params": weights}, {"params": biases, "lr": 0.02, "weight_decay": 0.0}],
        lr=0.05,
        weight_decay=0.01,
    )


def batches(epoch: int, rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s batches of ``epoch`` in a world of ``world``: a shard of one dataset,
    shuffled per epoch, equal counts on every rank (DistributedSampler's split)."""
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(SAMPLES, 6, generator=g), torch.randn(SAMPLES, 3, generator=g)
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(100 + epoch))
    mine = order[rank::world][: SAMPLES // world // BATCH * BATCH]
    return [(x[i], y[i]) for i in mine.split(BATCH)]


def train_epoch(
    strategy: Strategy,
    epoch: int,
    rank: int,
    world: int,
    *,
    die_at: int | None = None,
    note: Path | None = None,
) -> None:
    """One epoch of ``strategy``; ``die_at``: this rank is SIGKILLed at that batch, inside the
    gradients' all-reduce in DDP modes (a comm hook starts it, then the process dies), just
    before the step's collectives in mode main, before the forward's all-gather in FSDP2."""
    strategy.begin_epoch()
    strategy.module.train()
    if die_at is not None and strategy.ddp is not None:
        steps = [0]

        def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            work = dist.all_reduce(bucket.buffer(), async_op=True)
            if steps[0] == die_at:
                die_now(note)  # mid all_reduce: this rank's part of it is under way
            steps[0] += 1
            assert work is not None
            return work.get_future().then(lambda fut: fut.value()[0])  # type: ignore[no-any-return]

        # DDP checks the annotations themselves, which this module's future import makes strings
        hook.__annotations__ = {
            "bucket": dist.GradBucket,
            "return": torch.futures.Future[torch.Tensor],
        }
        strategy.ddp.register_comm_hook(None, hook)
    for i, (x, y) in enumerate(batches(epoch, rank, world)):
        if die_at == i and strategy.mode == "fully_sharded":
            die_now(note)
        strategy.zero_grad()
        with strategy.policy.autocast():
            loss = nn.functional.mse_loss(strategy.module(x).float(), y)
        strategy.policy.backward(loss)
        del loss  # its graph is the step's: nothing of it may outlive a failure
        if die_at == i and strategy.mode == "main":
            die_now(note)
        strategy.step()


def fails(run: Callable[[], None]) -> BaseException:
    """The error ``run`` raises (a survivor's broken collective); AssertionError if none."""
    try:
        run()
    except (RuntimeError, dist.DistError) as exc:
        return exc
    raise AssertionError("the collective went on without the lost rank")


# ---------------------------------------------------------------- what a rank holds


def record(strategy: Strategy) -> dict[str, Any]:
    """A deep copy of what ``strategy`` holds, read through torch's own APIs (not epochal's):
    the model's state, the optimizer's (index-keyed), the loss scaler's; and the generators."""
    scaler = strategy.policy.scaler
    return {
        "model": {k: v.detach().clone() for k, v in strategy.model.state_dict().items()},
        "optim": copy.deepcopy(strategy.optimizer.state_dict()),
        "scaler": None if scaler is None else scaler.state_dict(),
        "rng": rng_state(),
    }


def whole(model: nn.Module) -> dict[str, torch.Tensor]:
    """Whole parameters and buffers on the CPU (collective for a fully sharded model)."""
    return {
        k: (v.full_tensor() if is_dtensor(v) else v).detach().to("cpu", copy=True)  # type: ignore[attr-defined]
        for k, v in model.state_dict().items()
    }


def same(a: Any, b: Any, where: str = "state") -> None:
    """``a`` and ``b`` are equal bit for bit: tensors (dtype, shape, values, NaN where NaN),
    numbers, strings, and containers of them."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{list(a.shape)}"
        bits = [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
        assert torch.equal(*bits), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: {sorted(a)} {sorted(b)}"
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@contextmanager
def no_unpickling() -> Iterator[list[str]]:
    """Every unpickler of this process refuses to run (and says who called it), as torch's
    ``broadcast_object_list`` and ``torch.load`` would use it: the list yields what tried."""
    tried: list[str] = []

    def refuse(*args: Any, **kwargs: Any) -> Any:
        tried.append("".join(traceback.format_stack(limit=8)))
        raise AssertionError("a peer's bytes were unpickled")

    class Refusing(pickle.Unpickler):  # torch.load subclasses whatever pickle.Unpickler is
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            refuse()

    saved = (pickle.Unpickler, pickle.loads, pickle.load)
    c10d = dist.distributed_c10d
    saved_c10d = c10d._unpickler  # type: ignore[attr-defined]
    pickle.Unpickler, pickle.loads, pickle.load = Refusing, refuse, refuse  # type: ignore[misc]
    c10d._unpickler = Refusing  # type: ignore[attr-defined]
    try:
        yield tried
    finally:
        pickle.Unpickler, pickle.loads, pickle.load = saved  # type: ignore[misc]
        c10d._unpickler = saved_c10d  # type: ignore[attr-defined]


def save(tmp: Path, name: str, value: Any) -> None:
    torch.save(value, tmp / f"{name}.pt")


def load(tmp: Path, name: str) -> Any:
    return torch.load(tmp / f"{name}.pt", weights_only=False)
