"""The elastic bench's workload as a torchrun script that recovers the way torchrun's users do:
its elastic agent restarts every worker when one fails, and the script resumes from its own last
checkpoint.

    torchrun --nnodes 1 --nproc-per-node 4 --max-restarts 1 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:0 tests/integration/scripts/torchrun_resumable.py \\
        --out DIR --epochs 16

The model, data, batches and optimizer are those of ``resumable.py`` beside it, from
``resumable_workload.py`` (what ``bench/elastic.py`` runs under epochal): DDP over gloo, each rank
a shard of the rows, a checkpoint (model and optimizer, ``torch.save`` by rank 0, renamed into
place) after every epoch. Rank 0 prints ``training epoch E`` when an epoch starts, after any
checkpoint was loaded, and ``epoch E [E+1/N]`` when it ends, which is what the bench times.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from resumable_workload import train_loader, valid_loader, workload
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds added to each step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y, model, optimizer = workload()
    checkpoint = args.out / "checkpoint.pt"
    start = 0
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"] + 1
    ddp = DistributedDataParallel(model)
    train = train_loader(x, y, rank, world)
    valid = valid_loader(x, y, rank, world)
    for epoch in range(start, args.epochs):
        if rank == 0:
            print(f"training epoch {epoch}", flush=True)
        ddp.train()
        for inputs, targets in train:
            time.sleep(args.delay)
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(inputs), targets).backward()
            optimizer.step()
        model.eval()
        sums = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for inputs, targets in valid:
                time.sleep(args.delay)
                loss = nn.functional.cross_entropy(model(inputs), targets)
                sums += torch.tensor([float(loss) * len(targets), len(targets)])
        dist.all_reduce(sums)
        if rank == 0:
            args.out.mkdir(parents=True, exist_ok=True)
            partial = checkpoint.with_suffix(".partial")
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save({**state, "epoch": epoch}, partial)
            os.replace(partial, checkpoint)
            valid_loss = float(sums[0] / sums[1])
            print(f"epoch {epoch} [{epoch + 1}/{args.epochs}] valid {valid_loss:.4f}", flush=True)
        dist.barrier()
    del ddp  # it holds the group: dropped first, gloo's threads end at the destroy, not at exit
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
