"""A plain torchrun script, nothing of epochal in it: ``init_process_group()`` from the
environment (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``), DDP, a
``DistributedSampler`` and a loop of its own. Rank 0 saves the final weights to ``--out``.

``--fail-rank R``: rank R exits with status 3 right after the process group is made, while the
others sleep (``--others-sleep`` seconds) outside any collective: only the launcher can stop them.

``--join``: the same script with ``epochal.join()`` in place of ``init_process_group()``, for the
rendezvous and the process group only; the loop stays the script's own.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--fail-rank", type=int, default=None)
parser.add_argument("--others-sleep", type=float, default=600.0)
parser.add_argument("--join", action="store_true")
args = parser.parse_args()

torch.manual_seed(0)
inputs = torch.randn(96, 8)
targets = inputs @ torch.randn(8, 1) + 0.1 * torch.randn(96, 1)
data = TensorDataset(inputs, targets)
linear = nn.Linear(8, 1)

if args.join:
    import epochal

    group = epochal.join(linear)  # the rendezvous and the process group, nothing else
else:
    dist.init_process_group("gloo")
    group = contextlib.nullcontext()
with group:
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"rank {rank} of {world}, local rank {os.environ['LOCAL_RANK']}", flush=True)
    if args.fail_rank is not None:
        if rank == args.fail_rank:
            sys.exit(3)
        time.sleep(args.others_sleep)

    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    model = DistributedDataParallel(linear)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = 0.0
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            total += loss.item()
        print(f"rank {rank}: epoch {epoch} loss {total / len(loader):.4f}", flush=True)
    if rank == 0:
        torch.save(model.module.state_dict(), args.out)
    # A careful script's end: the DDP wrapper (in reference cycles) holds the process group, so
    # drop it before the group is destroyed; then gloo's threads end now, while the interpreter is
    # whole. Left to the interpreter's exit, one of them can drop a tensor there and abort the
    # process ('terminate called without an active exception'), seen under torchrun itself.
    del model, optimizer
    gc.collect()
if not args.join:
    dist.destroy_process_group()
