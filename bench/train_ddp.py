"""The baseline: the benchmark workload with plain torchrun + DistributedDataParallel over gloo.

    OMP_NUM_THREADS=1 torchrun --nnodes 1 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:0 bench/train_ddp.py --epochs 8 --out ddp.json

The process group comes from torchrun's environment (``env://``). Each epoch does what
:func:`epochal.train` does for the same workload: set the sampler's epoch, train every batch
through DDP, validate on the unwrapped model, and keep the best weights, restored at the end; the
global train and validation losses come from one ``all_reduce`` of the loss sums (what the
coordinator computes under epochal). Rank 0 writes its timings (see ``workload.Timings``) as JSON.
"""

from __future__ import annotations

import time

SCRIPT_START = time.time()  # before torch is imported: the launcher's share ends here

import argparse  # noqa: E402
import math  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from workload import (  # noqa: E402
    SEED,
    Timings,
    add_workload_arguments,
    datasets,
    loaders,
    model,
    optimizer,
)


def main() -> None:
    timings = Timings(script_start=SCRIPT_START, imported=time.time())
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    add_workload_arguments(parser)
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(SEED)  # the same initial weights on every rank
    train_set, valid_set = datasets(args)
    net = model(args)
    opt = optimizer(net, args)
    loss_fn = nn.functional.cross_entropy
    timings.built = time.time()

    dist.init_process_group(backend="gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    train_loader, valid_loader = loaders(train_set, valid_set, rank, world_size, args, timings)
    ddp = DistributedDataParallel(net)

    best_loss = math.inf
    best_state: dict[str, torch.Tensor] | None = None
    train_losses: list[float] = []
    valid_losses: list[float] = []
    for epoch in range(args.epochs):
        train_loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        ddp.train()
        total = torch.zeros((), dtype=torch.float64)
        count = 0
        for inputs, targets in train_loader:
            n = int(targets.shape[0])
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(inputs), targets)
            loss.backward()
            opt.step()
            total += loss.detach().double() * n
            count += n

        net.eval()
        valid_total = torch.zeros((), dtype=torch.float64)
        valid_count = 0
        with torch.no_grad():
            for inputs, targets in valid_loader:
                n = int(targets.shape[0])
                valid_total += loss_fn(net(inputs), targets).double() * n
                valid_count += n

        sums = torch.tensor(
            [float(total), count, float(valid_total), valid_count], dtype=torch.float64
        )
        dist.all_reduce(sums)
        train_losses.append(float(sums[0] / sums[1]))
        valid_losses.append(float(sums[2] / sums[3]))
        if valid_losses[-1] < best_loss:
            best_loss = valid_losses[-1]
            best_state = {k: v.detach().to("cpu", copy=True) for k, v in net.state_dict().items()}

    if best_state is not None:
        net.load_state_dict(best_state)
    timings.finished = time.time()
    if rank == 0:
        timings.write(
            args.out,
            "torchrun",
            world_size,
            {"train_losses": train_losses, "valid_losses": valid_losses},
        )
    # Drop DDP (its Reducer holds the process group) before the group: if the Reducer holds the
    # last reference, its destructor joins gloo's threads with the GIL held while one of them
    # waits for the GIL to free a finished all-reduce, and the process hangs (torch 2.13).
    del ddp
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
