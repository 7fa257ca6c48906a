"""What frequent epoch boundaries cost: ``epochal run --steps-per-epoch N`` against one pass of
the same steps under plain torchrun + DDP, which has no epochs at all, in one invocation.

    python bench/cadence.py [--steps 2000] [--steps-per-epoch 50] [--repeats 3] [--hidden 768]

Every run trains ``--steps`` optimizer steps of a 256-H-H-10 MLP (H = ``--hidden``; 768 takes
about 10 ms a step on one core here) on 2 workers over gloo, 64 samples a rank a step, from one
seeded synthetic dataset. Three kinds of run, interleaved and rotated on every repeat so that a
shared machine's drifts hit all alike:

- ``torchrun``: ``python -m torch.distributed.run`` and a plain DDP loop over the steps, no epochs;
- ``epochal``: ``epochal run --steps-per-epoch N --checkpoint-every 0``, ``epochal.train`` over
  ``epochal.batches``: an exchange with the coordinator every N steps;
- ``epochal+ckpt``: the same with a checkpoint at every epoch's end (``--checkpoint-every 1``).

Rank 0 of each run notes the instant each optimizer step ends; the figure is the wall time from
the end of the first step to the end of the last, so launch, rendezvous and the end of the run are
left out, and every epoch boundary but the last is in. It prints the median over the repeats of
each kind and the ratios against torchrun (targets: <= 1.01 without checkpoints, <= 1.03 with one
each epoch), and where an epoch's time goes: the median step, and the median gap at a boundary
(from the end of an epoch's last step to the end of the next epoch's first, less one median
step): the exchange with the coordinator, and the checkpoint where one is written. A checkpoint
written in the background costs the steps it overlaps instead, which the gap does not see: the
pace (the wall time over as many median steps) does, within each run as the share does.

It is a benchmark, not a test. Run with ``--worker`` by the launchers, never by hand.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from launchers import epochal_run_command, launch_env, torchrun_command

SAMPLES = 8192
FEATURES = 256
CLASSES = 10
PER_RANK = 64
SEED = 0
KINDS = ("torchrun", "epochal", "epochal+ckpt")
TARGETS = {"epochal": 1.01, "epochal+ckpt": 1.03}


# ----------------------------------------------------------------------------- the workers


def _workload(hidden: int) -> tuple[Any, Any, Any]:
    """The dataset, model and optimizer, the same on every rank and in every kind of run: the
    model and optimizer of ``compare.py``'s workload (``workload.py``), ``hidden`` wide, at a
    rate of 0.01, on a dataset of this benchmark's own."""
    import torch
    from torch.utils.data import TensorDataset
    from workload import model, optimizer

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(SEED)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    teacher = torch.randn(FEATURES, CLASSES, generator=generator)
    data = TensorDataset(x, (x @ teacher).argmax(1))
    torch.manual_seed(SEED)
    shape = argparse.Namespace(features=FEATURES, hidden=hidden, classes=CLASSES, lr=0.01)
    net = model(shape)
    return data, net, optimizer(net, shape)


def _worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch import nn

    data, net, opt = _workload(args.hidden)
    ends: list[float] = []
    opt.register_step_post_hook(lambda *_: ends.append(time.time()))
    global_batch = PER_RANK * 2
    if args.worker == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        from torch.utils.data import DataLoader, DistributedSampler

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=SEED)
        loader = DataLoader(data, batch_size=PER_RANK, sampler=sampler, drop_last=True)
        ddp = DistributedDataParallel(net)
        step, data_pass = 0, 0
        while step < args.steps:  # one pass after another, no epochs
            sampler.set_epoch(data_pass)
            for inputs, targets in loader:
                opt.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(ddp(inputs), targets).backward()
                opt.step()
                step += 1
                if step == args.steps:
                    break
            data_pass += 1
        if rank == 0:
            args.out.write_text(json.dumps({"ends": ends}))
        # torch 2.13 may deadlock freeing this DDP's reducer after the group is destroyed (its
        # gloo thread waits for the GIL the joining main thread holds), which hung a run until
        # the bench's timeout; the steps are measured and written, so skip the teardown
        os._exit(0)
    else:
        import epochal

        batches = epochal.batches(data, global_batch=global_batch, seed=SEED, drop_last=True)
        result = epochal.train(net, opt, batches, None, nn.functional.cross_entropy)
        rank = result.rank
    if rank == 0:
        args.out.write_text(json.dumps({"ends": ends}))


# ----------------------------------------------------------------------------- the runner


def _command(kind: str, args: argparse.Namespace, out: Path, run_dir: Path) -> list[str]:
    me = [str(Path(__file__).resolve()), "--out", str(out), "--hidden", str(args.hidden)]
    if kind == "torchrun":
        return torchrun_command(2, *me, "--worker", "ddp", "--steps", str(args.steps))
    epochs = -(-args.steps // args.steps_per_epoch)
    every = "1" if kind == "epochal+ckpt" else "0"
    return epochal_run_command(
        2,
        epochs,
        run_dir,
        "--steps-per-epoch",
        str(args.steps_per_epoch),
        "--checkpoint-every",
        every,
        *me,
        "--worker",
        "epochal",
    )


def _run(kind: str, args: argparse.Namespace, scratch: Path, repeat: int) -> list[float]:
    """One run of ``kind``: the instants its rank 0's optimizer steps ended."""
    out = scratch / f"{kind}-{repeat}.json"
    done = subprocess.run(
        _command(kind, args, out, scratch / f"run-{kind}-{repeat}"),
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=args.timeout,
    )
    if done.returncode != 0:
        sys.exit(f"{kind} run {repeat} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    ends: list[float] = json.loads(out.read_text())["ends"]
    return ends


def _boundary_gap(ends: list[float], steps_per_epoch: int) -> float:
    """The median extra time at an epoch boundary: the end of an epoch's last step to the end
    of the next epoch's first, less the median step."""
    steps = [b - a for a, b in itertools.pairwise(ends)]
    step = statistics.median(steps)
    at = [steps[i] for i in range(steps_per_epoch - 1, len(steps), steps_per_epoch)]
    return statistics.median(at) - step if at else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--steps-per-epoch", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--worker", choices=("ddp", "epochal"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        _worker(args)
        return
    walls: dict[str, list[float]] = {kind: [] for kind in KINDS}
    steps: dict[str, list[float]] = {kind: [] for kind in KINDS}
    gaps: dict[str, list[float]] = {kind: [] for kind in KINDS}
    paces: dict[str, list[float]] = {kind: [] for kind in KINDS}
    with tempfile.TemporaryDirectory(prefix="cadence-") as tmp:
        for repeat in range(args.repeats):
            order = KINDS[repeat % 3 :] + KINDS[: repeat % 3]  # each kind leads once in three
            for kind in order:
                ends = _run(kind, args, Path(tmp), repeat)
                if len(ends) != args.steps:
                    sys.exit(f"{kind} run {repeat} stepped {len(ends)} times, not {args.steps}")
                walls[kind].append(ends[-1] - ends[0])
                steps[kind].append(statistics.median(b - a for a, b in itertools.pairwise(ends)))
                gaps[kind].append(_boundary_gap(ends, args.steps_per_epoch))
                paces[kind].append(walls[kind][-1] / ((len(ends) - 1) * steps[kind][-1]))
                print(
                    f"  {kind:13} repeat {repeat}: {walls[kind][-1]:.2f} s, median step "
                    f"{steps[kind][-1] * 1000:.2f} ms",
                    flush=True,
                )
    base = statistics.median(walls["torchrun"])
    print(
        f"\n{args.steps} steps, 2 workers, gloo, hidden {args.hidden}; epochal epochs of "
        f"{args.steps_per_epoch} steps; medians of {args.repeats} runs each"
    )
    print(
        f"{'':14}{'wall s':>9}{'ratio':>8}{'paired':>8}{'target':>8}{'step ms':>9}"
        f"{'boundary ms':>13}{'share':>8}{'pace':>8}"
    )
    for kind in KINDS:
        wall = statistics.median(walls[kind])
        target = f"{TARGETS[kind]:.2f}" if kind in TARGETS else "-"
        gap = statistics.median(gaps[kind]) * 1000 if kind != "torchrun" else 0.0
        step = statistics.median(steps[kind]) * 1000
        share = gap / (args.steps_per_epoch * step)  # what the boundaries add, in this run alone
        # each repeat's runs ran one after another: their ratio, where a drift hits both alike
        paired = statistics.median(
            a / b for a, b in zip(walls[kind], walls["torchrun"], strict=True)
        )
        print(
            f"{kind:14}{wall:9.2f}{wall / base:8.3f}{paired:8.3f}{target:>8}{step:9.2f}"
            f"{gap:13.1f}{1 + share:8.3f}{statistics.median(paces[kind]):8.3f}"
        )
    epochs = args.steps // args.steps_per_epoch
    print(
        "\nratio: the median wall time over torchrun's; paired: the median over the repeats of "
        "each repeat's wall time over that repeat's torchrun run (they ran one after another, "
        "so a machine whose speed drifts between repeats moves both)"
    )
    print(
        f"boundary ms: the median extra time at each of the {epochs - 1} epoch boundaries "
        "(exchange with the coordinator; and the checkpoint, for epochal+ckpt); share: 1 + "
        "that over an epoch's steps, the ratio the boundaries alone give, which a loaded "
        "machine's drift between runs does not blur; pace: the wall time over as many median "
        "steps, the boundaries and the steps a background write slows, against torchrun's own"
    )


if __name__ == "__main__":
    main()
