"""The benchmark workload under epochal: ``epochal.train`` started by ``epochal run``.

    OMP_NUM_THREADS=1 epochal run --nproc 2 --epochs 8 bench/train_epochal.py --out epochal.json

The same data, model, optimizer, loaders and batch size as ``train_ddp.py``; the coordinator
starts every epoch and decides the best one. The timing probes sit in the loaders
(``workload.TimedLoader``), outside epochal, so the per-epoch figure covers all of epochal's
per-epoch work: the ready/go and report/decision exchanges, the per-batch abort checks, the copy
of the best weights and, where ``epochal run`` checkpoints, the checkpoint. Rank 0 writes its
timings as JSON.
"""

from __future__ import annotations

import time

SCRIPT_START = time.time()  # before torch is imported: the launcher's share ends here

import argparse  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from workload import (  # noqa: E402
    SEED,
    TimedLoader,
    Timings,
    add_workload_arguments,
    datasets,
    loaders,
    model,
    optimizer,
)

from epochal import train  # noqa: E402  (imports the worker API: torch, pyzmq, msgpack)


def main() -> None:
    timings = Timings(script_start=SCRIPT_START, imported=time.time())
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser)
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(SEED)  # the same initial weights on every rank
    train_set, valid_set = datasets(args)
    net = model(args)
    opt = optimizer(net, args)
    timings.built = time.time()

    built: dict[str, Any] = {}

    def train_loader(rank: int, world_size: int) -> TimedLoader:
        # called by epochal.train right after join(): the process group is up
        built["train"], built["valid"] = loaders(
            train_set, valid_set, rank, world_size, args, timings
        )
        return built["train"]  # type: ignore[no-any-return]

    def valid_loader(rank: int, world_size: int) -> DataLoader[Any]:
        return built["valid"]  # type: ignore[no-any-return]

    result = train(
        net, opt, train_loader, valid_loader, nn.functional.cross_entropy, progress=False
    )
    timings.finished = time.time()
    if result.rank == 0:
        timings.write(
            args.out,
            "epochal",
            result.world_size,
            {
                "train_losses": [r.train_loss for r in result.curve],
                "valid_losses": [r.valid_loss for r in result.curve],
                "epochal_seconds": [r.seconds for r in result.curve],
            },
        )


if __name__ == "__main__":
    main()
