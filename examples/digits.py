"""Train a digit classifier on scikit-learn's bundled handwritten digits, data-parallel.

    epochal run --nproc 2 --epochs 15 examples/digits.py

Each worker trains on its own shard of the training set (a DistributedSampler built once the rank
is known); the coordinator picks the best epoch by validation loss (``--monitor accuracy
--monitor-mode max``: by validation accuracy, a metric every worker reports and the coordinator
sums over the ranks' samples), every worker ends with the best weights, and rank 0 reports that
epoch's test accuracy. Seeded: the same arguments print the same numbers.
"""

from __future__ import annotations

import argparse

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import epochal


def datasets(seed: int) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
    """The 1,797 digits split 60/20/20 into train, validation and test, the same on every rank."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    a, b = int(0.6 * len(x)), int(0.8 * len(x))
    return TensorDataset(x[:a], y[:a]), TensorDataset(x[a:b], y[a:b]), TensorDataset(x[b:], y[b:])


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 10))


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Correct predictions in the batch and its size: epochal sums both over every rank."""
    return (outputs.argmax(dim=1) == targets).sum(), len(targets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    train_set, valid_set, test_set = datasets(args.seed)
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)

    def shard(dataset: TensorDataset, shuffle: bool):
        def build(rank: int, world_size: int) -> DataLoader:
            sampler = DistributedSampler(
                dataset,
                num_replicas=world_size,
                rank=rank,
                shuffle=shuffle,
                seed=args.seed,
                drop_last=True,
            )
            return DataLoader(
                dataset, batch_size=args.batch_size, sampler=sampler, drop_last=shuffle
            )

        return build

    result = epochal.train(
        net,
        optimizer,
        shard(train_set, True),
        shard(valid_set, False),
        nn.functional.cross_entropy,
        metrics={"accuracy": accuracy},
    )

    if result.rank != 0:
        return
    net.eval()
    device = next(net.parameters()).device  # train() leaves the model on the worker's device
    with torch.no_grad():
        x, y = (t.to(device) for t in test_set.tensors)
        test_accuracy = (net(x).argmax(dim=1) == y).float().mean().item()
    best = result.best
    assert best is not None
    print(
        f"best epoch {result.best_epoch} of {result.epochs_run}: train loss {best.train_loss:.4f}, "
        f"valid loss {best.valid_loss:.4f}, valid accuracy {best.metrics['valid_accuracy']:.4f}, "
        f"test accuracy {test_accuracy:.4f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
