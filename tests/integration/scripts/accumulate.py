"""Gradient accumulation under DDP: count all-reduces and optimizer steps, write them as JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import epochal


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--accumulate", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    counts = {"allreduce": 0, "step": 0}

    def counting_hook(state, bucket):
        counts["allreduce"] += 1
        return allreduce_hook(state, bucket)

    def configure(ddp: nn.parallel.DistributedDataParallel) -> None:
        ddp.register_comm_hook(None, counting_hook)

    def count_step(*_: object) -> None:
        counts["step"] += 1

    optimizer.register_step_post_hook(count_step)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)) for _ in range(8)]
    result = epochal.train(
        model,
        optimizer,
        data,
        None,
        nn.functional.mse_loss,
        accumulate=args.accumulate,
        configure_ddp=configure,
        ddp_options={"bucket_cap_mb": 100},  # one bucket: one all-reduce per synchronised step
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{result.rank}.json").write_text(json.dumps(counts))


if __name__ == "__main__":
    main()
