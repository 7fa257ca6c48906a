"""Benchmark ``epochal run`` against plain torchrun + DDP on the same workload, in one invocation.

    python bench/compare.py [--nproc 2] [--epochs 10] [--repeats 3] [-- WORKLOAD OPTIONS]

Runs ``train_ddp.py`` under torchrun and ``train_epochal.py`` under ``epochal run``, ``--repeats``
times each, alternating (and swapping which goes first every repeat) so that slow drifts of a
shared machine hit both alike. Each run's launch instant is ``time.time()`` just before the
launcher command is spawned; the workers' rank 0 writes the rest (see ``workload.Timings``). The
report gives, per run, the launch-to-first-step time split into phases and the median epoch time,
then the two ratios epochal / torchrun with their targets:

- per-epoch wall time: median over the epochs of all runs, each run's first (warm-up) and last
  (no next start ends it) left out, target <= 1.02;
- launch to the first training step: median over runs, target <= 1.0.

Options the script does not know (e.g. ``--samples 8192 --hidden 256``) go to both training
scripts. Exit status: 0 when every run succeeded (1 with ``--check`` when a target is missed),
1 when a run failed (its output is printed).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launchers import epochal_run_command, launch_env, torchrun_command

BENCH = Path(__file__).resolve().parent
MODES = ("torchrun", "epochal")
EPOCH_TARGET = 1.02
STARTUP_TARGET = 1.0
PHASES = (
    ("start", "launch_", "script_start", "launcher + interpreter start, until the script runs"),
    ("import", "script_start", "imported", "import torch (and epochal)"),
    ("build", "imported", "built", "data, model, optimizer"),
    ("join", "built", "joined", "rendezvous + process group"),
    ("step", "joined", "first_step", "DDP wrap + first batch"),
)


@dataclass
class Run:
    """One launch of one mode: when it started and ended, and what its rank 0 wrote."""

    mode: str
    repeat: int
    launch: float
    exit: float
    record: dict[str, Any]

    def at(self, key: str) -> float:
        """The instant ``key`` from the JSON, or the launch instant for ``launch_``."""
        return self.launch if key == "launch_" else float(self.record[key])

    @property
    def to_first_step(self) -> float:
        return self.at("first_step") - self.launch

    @property
    def epochs(self) -> list[float]:
        """Per-epoch wall times (start to next start) without the warm-up epoch 0."""
        return [float(s) for s in self.record["epoch_seconds"][1:]]


def command(
    mode: str, args: argparse.Namespace, out: Path, run_dir: Path, workload: list[str]
) -> list[str]:
    """The launcher command line for ``mode``; both start from this interpreter's ``-m``."""
    if mode == "torchrun":
        return torchrun_command(
            args.nproc,
            "--max-restarts",
            "0",
            "--rdzv-id",
            uuid.uuid4().hex,
            str(BENCH / "train_ddp.py"),
            "--epochs",
            str(args.epochs),
            "--out",
            str(out),
            *workload,
        )
    return epochal_run_command(
        args.nproc,
        args.epochs,
        run_dir,
        *shlex.split(args.epochal_args),
        str(BENCH / "train_epochal.py"),
        "--out",
        str(out),
        *workload,
    )


def launch(
    mode: str,
    repeat: int,
    args: argparse.Namespace,
    workload: list[str],
    scratch: Path,
    env: dict[str, str],
) -> Run:
    """Run one launcher to completion; exit the benchmark if it fails."""
    tag = f"{mode}-{repeat}"
    out, log = scratch / f"{tag}.json", scratch / f"{tag}.log"
    argv = command(mode, args, out, scratch / f"{tag}-run", workload)
    with log.open("wb") as sink:
        started = time.time()
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=scratch,
        )
        code = proc.wait()
        ended = time.time()
    if code != 0 or not out.is_file():
        tail = log.read_text(errors="replace").splitlines()[-40:]
        print(f"\n{tag} failed (status {code}): {' '.join(argv)}", file=sys.stderr)
        print("\n".join(tail), file=sys.stderr)
        raise SystemExit(1)
    return Run(mode, repeat, started, ended, json.loads(out.read_text()))


def ratio_line(name: str, base: float, ours: float, target: float, unit: str = "s") -> str:
    """One summary line: both medians, their ratio, the target and the verdict."""
    ratio = ours / base
    verdict = "PASS" if ratio <= target else "MISS"
    return (
        f"{name:<26} {base:>9.3f} {unit}  {ours:>9.3f} {unit}  {ratio:>7.3f}   "
        f"<= {target:<5g} {verdict}"
    )


def report(runs: list[Run]) -> tuple[float, float]:
    """Print the per-run table and the summary; return the two ratios (epoch, startup)."""
    heads = "".join(f"{name:>8}" for name, *_ in PHASES)
    print(f"\n{'run':<12}{heads}{'=first':>9}{'epoch med':>11}{'epochs':>8}{'exit':>7}{'total':>8}")
    for run in runs:
        phases = "".join(f"{run.at(b) - run.at(a):>8.2f}" for _, a, b, _ in PHASES)
        print(
            f"{run.mode + ' ' + str(run.repeat):<12}{phases}{run.to_first_step:>9.2f}"
            f"{statistics.median(run.epochs):>11.3f}{len(run.epochs):>8}"
            f"{run.exit - run.at('finished'):>7.2f}{run.exit - run.launch:>8.2f}"
        )
    legend = [f"{n}: {d}" for n, _, _, d in PHASES] + [
        "=first: launch to first step (the sum of the above)",
        "epoch med: median epoch time, epoch 0 left out",
        "exit: rank 0's training call returning to the launcher's exit",
        "total: launch to launcher exit",
    ]
    print("(seconds)\n" + "\n".join(f"  {line}" for line in legend))

    by_mode = {m: [r for r in runs if r.mode == m] for m in MODES}
    epoch = {m: statistics.median(s for r in rs for s in r.epochs) for m, rs in by_mode.items()}
    first = {m: statistics.median(r.to_first_step for r in rs) for m, rs in by_mode.items()}
    print("\nmedian phase times (s)    " + "".join(f"{name:>8}" for name, *_ in PHASES))
    for m, rs in by_mode.items():
        medians = [statistics.median(r.at(b) - r.at(a) for r in rs) for _, a, b, _ in PHASES]
        print(f"  {m:<24}" + "".join(f"{v:>8.2f}" for v in medians))

    gaps = [
        iv - own
        for r in by_mode["epochal"]
        for iv, own in zip(
            r.record["epoch_seconds"][1:], r.record["epochal_seconds"][1:], strict=False
        )
    ]
    print(
        "\nepochal between epochs (epoch interval - the epoch seconds epochal reports: "
        "best-weights copy, checkpoint if any, ready/go), median: "
        f"{1000 * statistics.median(gaps):.1f} ms"
    )
    pairs = [
        (base, next(r for r in by_mode["epochal"] if r.repeat == base.repeat))
        for base in by_mode["torchrun"]
    ]
    epoch_pairs = [statistics.median(e.epochs) / statistics.median(t.epochs) for t, e in pairs]
    first_pairs = [e.to_first_step / t.to_first_step for t, e in pairs]
    print("per-repeat ratios epochal / torchrun (their spread is the run-to-run noise):")
    print("  per-epoch wall:       " + ", ".join(f"{x:.3f}" for x in epoch_pairs))
    print("  launch -> first step: " + ", ".join(f"{x:.3f}" for x in first_pairs))
    same = all(r.record["valid_losses"] == runs[0].record["valid_losses"] for r in runs)
    print(f"\nvalidation losses identical across all runs: {'yes' if same else 'NO'}")
    print(f"\n{'epochal / torchrun':<26} {'torchrun':>11}  {'epochal':>11}  {'ratio':>7}   target")
    print(ratio_line("per-epoch wall (median)", epoch["torchrun"], epoch["epochal"], EPOCH_TARGET))
    print(ratio_line("launch -> first step", first["torchrun"], first["epochal"], STARTUP_TARGET))
    return epoch["epochal"] / epoch["torchrun"], first["epochal"] / first["torchrun"]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Unknown options are passed to both training scripts (see bench/workload.py).",
    )
    parser.add_argument("--nproc", type=int, default=2, help="workers per run (default: 2)")
    parser.add_argument(
        "--epochs",
        type=int,
        default=10,
        help="epochs per run (default: 10); timed: all but epoch 0 (warm-up) "
        "and the last (no next epoch start ends it)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode (default: 3)")
    parser.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip the untimed 3-epoch run of each mode that warms the caches",
    )
    parser.add_argument(
        "--keep",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep every run's JSON and log in DIR (default: a temporary folder)",
    )
    parser.add_argument(
        "--epochal-args",
        default="--checkpoint-every 0",
        metavar="'OPTIONS'",
        help="extra `epochal run` options, one quoted string (default: "
        "'--checkpoint-every 0', like the baseline, which does not "
        "checkpoint; bench/checkpoint_cost.py measures checkpoints)",
    )
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when a ratio misses its target"
    )
    args, workload = parser.parse_known_args()
    workload = [a for a in workload if a != "--"]
    if args.epochs < 3 or args.repeats < 1 or args.nproc < 1:
        parser.error("need --epochs >= 3, --repeats >= 1 and --nproc >= 1")

    env = launch_env()

    with tempfile.TemporaryDirectory(prefix="epochal-bench-") as tmp:
        scratch = args.keep or Path(tmp)
        scratch.mkdir(parents=True, exist_ok=True)
        print(
            f"{args.nproc} workers, {args.epochs} epochs, {args.repeats} repeats, "
            f"OMP_NUM_THREADS=1, workload options: {' '.join(workload) or '(defaults)'}, "
            f"epochal run options: {args.epochal_args or '(defaults)'}"
        )
        if args.warmup:
            warm = argparse.Namespace(**{**vars(args), "epochs": 3})
            for mode in MODES:
                print(f"warm-up {mode} ...", flush=True)
                launch(mode, 0, warm, workload, scratch, env)
        runs: list[Run] = []
        for repeat in range(1, args.repeats + 1):
            order = MODES if repeat % 2 else MODES[::-1]
            for mode in order:
                run = launch(mode, repeat, args, workload, scratch, env)
                runs.append(run)
                print(
                    f"{mode} {repeat}: first step after {run.to_first_step:.2f} s, "
                    f"epoch median {statistics.median(run.epochs):.3f} s",
                    flush=True,
                )
        epoch_ratio, startup_ratio = report(runs)
    missed = epoch_ratio > EPOCH_TARGET or startup_ratio > STARTUP_TARGET
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
