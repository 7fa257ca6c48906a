"""A custom loop under epochal.join(): each rank trains on its own data, with or without DDP.

``--plain`` trains the bare model (no gradient averaging, as a user who forgot DDP would), so the
ranks' weights part after the first step; by default the model is wrapped in DDP and they agree.
"""

from __future__ import annotations

import argparse

import torch

import epochal


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plain", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    with epochal.join(model) as session:
        generator = torch.Generator().manual_seed(100 + session.rank)  # each rank its own data
        data = [
            (torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator))
            for _ in range(4)
        ]
        net = model if args.plain else torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        def train_epoch(ctx: epochal.EpochContext) -> epochal.LossSum:
            total, count = 0.0, 0
            for _, (x, y) in zip(range(ctx.train_batches), data, strict=False):
                ctx.check()
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(net(x), y)
                loss.backward()
                optimizer.step()
                total += loss.item() * len(y)
                count += len(y)
            return epochal.LossSum(total, count)

        result = session.run_epochs(train_epoch, batches=(len(data), None))
        print(f"rank {session.rank}: done after {result.epochs_run} epochs", flush=True)


if __name__ == "__main__":
    main()
