"""Optimization modes side by side: optimizer-state bytes per rank and per-epoch time.

Trains the same ~10M-parameter MLP with Adam in every mode (``replicated``, ``main``,
``sharded``, ``fully_sharded``) on ``--nproc`` CPU ranks (gloo, one thread each), in one run, and
prints per mode:

- the optimizer-state bytes each rank holds after training, the largest of them, and that
  largest relative to ``replicated`` (target for the sharded modes: at most 1/N + 5%, i.e.
  ``1.05 / N``);
- the median epoch time relative to ``replicated``.

The modes run in rounds (``--repeats``), the order reversed every other round, each round with
fresh models; the first epoch of each mode in each round is warm-up and dropped. The model is
12 square hidden layers (so ZeRO's greedy partition can split them evenly over 2, 3, 4 or 6
ranks) between a narrow input and a 10-way output.

    python bench/strategies.py                 # 2 ranks, 3 epochs of 10 batches, 3 rounds: ~1 min
    python bench/strategies.py --nproc 3 --epochs 4 --batches 10 --repeats 3
    python bench/strategies.py --check         # exit 1 when a sharded mode misses the target

It is a benchmark, not a test: nothing under ``bench/`` is collected by pytest.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from epochal.worker.strategies import MODES, wrap

TARGET_SLACK = 0.05  # the sharded modes' per-rank state may exceed 1/N by this much


def build_model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(args.features, args.width), nn.ReLU()]
    for _ in range(args.hidden):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    layers.append(nn.Linear(args.width, args.classes))
    return nn.Sequential(*layers)


def rank_data(args: argparse.Namespace, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1 + rank)
    return [
        (
            torch.randn(args.batch_size, args.features, generator=g),
            torch.randint(0, args.classes, (args.batch_size,), generator=g),
        )
        for _ in range(args.batches)
    ]


def epoch(strategy: Any, data: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """One epoch as ``epochal.fit`` trains it; wall seconds, all ranks done."""
    dist.barrier()
    started = time.perf_counter()
    strategy.module.train()
    for x, y in data:
        strategy.zero_grad()
        nn.functional.cross_entropy(strategy.module(x), y).backward()
        strategy.step()
    dist.barrier()
    return time.perf_counter() - started


def rank_main(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=600),
    )
    try:
        data = rank_data(args, rank)
        times: dict[str, list[float]] = {m: [] for m in args.modes}
        state_bytes: dict[str, int] = {}
        for round_ in range(args.repeats):
            order = args.modes if round_ % 2 == 0 else args.modes[::-1]
            for mode in order:
                model = build_model(args)
                optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
                strategy = wrap(model, optimizer, torch.device("cpu"), mode=mode)
                epoch(strategy, data)  # warm-up: first buckets, first optimizer state
                times[mode] += [epoch(strategy, data) for _ in range(args.epochs)]
                state_bytes[mode] = strategy.optimizer_state_bytes()
                del strategy, optimizer, model
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, state_bytes)
        if rank == 0:
            n_params = sum(p.numel() for p in build_model(args).parameters())
            torch.save({"times": times, "bytes": gathered, "params": n_params}, out)
    finally:
        dist.destroy_process_group()


def report(args: argparse.Namespace, result: dict[str, Any]) -> bool:
    world = args.nproc
    per_rank = {m: [r[m] for r in result["bytes"]] for m in args.modes}
    median = {m: statistics.median(result["times"][m]) for m in args.modes}
    ref_bytes = max(per_rank["replicated"]) if "replicated" in per_rank else None
    ref_time = median.get("replicated")
    target = (1 + TARGET_SLACK) / world
    print(
        f"model: {result['params'] / 1e6:.2f} M parameters, Adam; {world} ranks (gloo, CPU, 1 "
        f"thread each); {args.batches} batches of {args.batch_size} per rank per epoch; "
        f"{args.epochs} timed epochs x {args.repeats} rounds per mode"
    )
    print()
    header = (
        f"{'mode':<14} {'opt-state bytes per rank (MB)':<32} {'max/replicated':>14} "
        f"{'target':<17} {'epoch median':>12} {'/replicated':>12}"
    )
    print(header)
    print("-" * len(header))
    ok = True
    for mode in args.modes:
        mb = ", ".join(f"{b / 1e6:.1f}" for b in per_rank[mode])
        ratio = max(per_rank[mode]) / ref_bytes if ref_bytes else float("nan")
        verdict = ""
        if mode in ("sharded", "fully_sharded"):
            passed = ratio <= target
            ok &= passed
            verdict = f"<= {target:.3f} {'PASS' if passed else 'MISS'}"
        t_ratio = median[mode] / ref_time if ref_time else float("nan")
        print(
            f"{mode:<14} {mb:<32} {ratio:>14.3f} {verdict:<17} {median[mode]:>11.3f}s "
            f"{t_ratio:>12.3f}"
        )
    print()
    print("epoch times (s), every timed epoch:")
    for mode in args.modes:
        print(f"  {mode:<14} " + " ".join(f"{t:.2f}" for t in result["times"][mode]))
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per mode per round")
    parser.add_argument("--batches", type=int, default=10, help="batches per rank per epoch")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over all modes")
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--width", type=int, default=912)
    parser.add_argument("--hidden", type=int, default=12, help="square hidden layers")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args()
    if "replicated" not in args.modes:
        args.modes = ["replicated", *args.modes]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.pt")
        mp.start_processes(
            rank_main,
            args=(args.nproc, str(Path(tmp) / "store"), args, out),
            nprocs=args.nproc,
            start_method="spawn",
        )
        result = torch.load(out)
    ok = report(args, result)
    if args.check and not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
