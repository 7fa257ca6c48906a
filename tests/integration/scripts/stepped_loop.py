"""A custom loop under epochal.join() over ``epochal.batches``, with ``--steps-per-epoch``: each
epoch makes this rank's loader at the run's data position (``ctx.batches_done``) and trains
``ctx.train_batches`` batches of it. Writes, to a file of its own process, one line an epoch
(``ctx epoch steps batches_done data_pass pass_batch``) and one line a batch (``batch world
rank epoch step id id ...``).
"""

from __future__ import annotations

import argparse
import itertools
import os
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

import epochal


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--global-batch", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(args.samples, 4)
    y = x.sum(1, keepdim=True)
    ids = torch.arange(args.samples)
    data = epochal.batches(TensorDataset(ids, ids), global_batch=args.global_batch, seed=3)
    model = torch.nn.Linear(4, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / f"ids-{os.getpid()}.txt").open("a", buffering=1)
    with epochal.join(model) as session:
        net = DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

        def train_epoch(ctx: epochal.EpochContext) -> epochal.LossSum:
            log.write(
                f"ctx {ctx.epoch} {ctx.steps_per_epoch} {ctx.batches_done} {ctx.data_pass} "
                f"{ctx.pass_batch}\n"
            )
            loader = data.loader(ctx.rank, ctx.world_size, start=ctx.batches_done, endless=True)
            total, count = 0.0, 0
            for step, (batch_ids, _) in enumerate(itertools.islice(loader, ctx.train_batches)):
                ctx.check()
                where = f"batch {ctx.world_size} {ctx.rank} {ctx.epoch} {step} "
                log.write(where + " ".join(map(str, batch_ids.tolist())) + "\n")
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(net(x[batch_ids]), y[batch_ids])
                loss.backward()
                optimizer.step()
                total += loss.item() * len(batch_ids)
                count += len(batch_ids)
            return epochal.LossSum(total, count)

        steps = session.steps_per_epoch
        assert steps is not None, "run with --steps-per-epoch"
        session.run_epochs(train_epoch, batches=(steps, None), passes=data.shape)


if __name__ == "__main__":
    main()
