"""What a lost worker costs: an elastic run (the others carry on) against a restart of everyone.

    python bench/elastic.py [--kills 5] [--nproc 4] [--seed 0] [--epochs 10]

Side by side on the resume test's workload (``resumable.py``, 10 epochs, 4 workers), ``--kills``
trials each of

- elastic: ``--min-workers NPROC-1``; a random worker is SIGKILLed a random moment into training,
  and the time is taken from the kill until the coordinator logs the new world formed (its Go goes
  out at that moment: the survivors train again);
- restart-all: ``--max-restarts 1`` (today's recovery, and torchrun's: every worker stopped and
  started again); from the kill until the restarted coordinator has welcomed a full set of new
  workers (they load the last checkpoint next, and redo every epoch since it);
- replaced: ``--min-workers NPROC-1 --max-restarts 1``: the elastic run, and a replacement started
  at once that joins at the next epoch boundary. Besides the time to train again, from the
  replacement's hello (the coordinator's "waiting to join" line) to the world at full size formed,
  and the rate at which the replacement took rank 0's state;
- torchrun: the same workload as a torchrun script (``torchrun_resumable.py``: DDP, a checkpoint
  of its own after every epoch) under ``torchrun --nnodes 1 --nproc-per-node NPROC
  --max-restarts 1 --rdzv-backend c10d``, whose elastic agent stops every worker when one fails
  and starts them all again; from the kill until rank 0 of the new workers starts training, its
  checkpoint loaded. (A node range, ``--nnodes 1:4``, adds the rendezvous' last call, 30 s by
  default, to every start and restart on one machine: left out.)

For each: the wall time the run lost against an undisturbed run of the same launcher started just
before it (a shared machine's speed drifts by more than a lost worker costs over a few minutes).
Prints medians and maxima, and the ratios restart-all / elastic and torchrun / elastic. Defaults
apply otherwise (heartbeats, abort grace, the settle window of 0.25 s).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from faults import SCRIPT, marked

TORCHRUN_SCRIPT = SCRIPT.with_name("torchrun_resumable.py")
"""The same workload as a torchrun script that resumes from its own checkpoint (beside
``resumable.py``, whose workload it imports)."""

RECOVERY_DEADLINE = 180.0
"""Seconds after a kill by which a run that has not trained again counts as failed (hung)."""

EPOCHS = 10
"""Epochs of each run (``--epochs``): enough for a kill well inside training; a replacement needs
more on a machine where its interpreter starts slowly."""


def workers_of(launcher: int, mark: str) -> list[int]:
    """The launcher's worker processes: its children among the marked ones (rank 0's store
    server is rank 0's child; torchrun's workers are its agent's)."""
    pids = []
    for pid in marked(mark):
        try:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == launcher:
            pids.append(pid)
    return pids


def stamped(lines: list[tuple[float, str]], needle: str) -> float | None:
    """When the first line holding ``needle`` arrived."""
    return next((t for t, line in lines if needle in line), None)


def join_figures(lines: list[tuple[float, str]]) -> tuple[float, float] | None:
    """A replacement's seconds from its hello to the full world formed, and the bytes per second
    it took rank 0's state at; None when it did not join."""
    hello, formed = stamped(lines, "is waiting to join"), stamped(lines, "generation 2 formed")
    said = next((line for _, line in lines if "took rank 0's state" in line), None)
    if hello is None or formed is None or said is None:
        return None
    size, unit = said.split("(")[-1].split("/s)")[0].split()
    rate = float(size) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    return formed - hello, rate


def run(
    rng: random.Random,
    nproc: int,
    extra: list[str],
    tmp: Path,
    *,
    kill: str | None,
    seen: list[list[tuple[float, str]]] | None = None,
    epochs: int = EPOCHS,
    torchrun: bool = False,
) -> tuple[float, float | None]:
    """One ``epochal run`` (or, ``torchrun``, the same workload under torchrun's elastic agent):
    its wall time, and (``kill`` given) the seconds from the kill to the line ``kill`` names.
    ``seen`` gets the run's lines, each with when it arrived."""
    mark = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
    env.update({"EPOCHAL_BENCH_MARK": mark, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    run_dir = tmp / mark
    if torchrun:
        # one node: a node range (--nnodes 1:N) would add the rendezvous' last call, 30 s by
        # default, to each start and restart, waiting for nodes that never come
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1"]
        cmd += ["--nproc-per-node", str(nproc), *extra, "--rdzv-backend", "c10d"]
        cmd += ["--rdzv-endpoint", "127.0.0.1:0", str(TORCHRUN_SCRIPT), "--out", str(run_dir)]
        cmd += ["--epochs", str(epochs)]
    else:
        cmd = [sys.executable, "-m", "epochal", "run", "--nproc", str(nproc)]
        cmd += ["--epochs", str(epochs), "--run-dir", str(run_dir), *extra, str(SCRIPT)]
        cmd += ["--out", str(run_dir / "out")]
    cmd += ["--delay", "0.02"]
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    stamps: list[tuple[float, str]] = []

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            stamps.append((time.monotonic(), line))
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    took = None
    try:
        if kill is not None:
            while not any("epoch 1 [" in line for line in lines):  # well into training
                if proc.poll() is not None:
                    raise RuntimeError("".join(lines))
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.8))
            before = sum(kill in line for line in lines)
            if proc.poll() is not None or any(f"epoch {epochs - 1} [" in line for line in lines):
                raise RuntimeError("the run finished before the kill: give it more epochs")
            os.kill(rng.choice(workers_of(proc.pid, mark)), signal.SIGKILL)
            killed = time.monotonic()
            while sum(kill in line for line in lines) <= before:
                if proc.poll() is not None:
                    raise RuntimeError("".join(lines))
                if time.monotonic() - killed > RECOVERY_DEADLINE:
                    hung = f"no training again within {RECOVERY_DEADLINE:g} s of the kill"
                    raise RuntimeError("".join(lines) + f"\nHungError: {hung}")
                time.sleep(0.005)
            took = time.monotonic() - killed
        code = proc.wait(timeout=300)
        if code != 0:
            raise RuntimeError(f"exit {code}:\n" + "".join(lines))
        reader.join(timeout=5)
        if seen is not None:
            seen.append(stamps)
        return time.monotonic() - started, took
    finally:
        for pid in marked(mark):
            os.kill(pid, signal.SIGKILL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument(
        "--only", default=None, help="these columns alone, comma-separated (elastic,torchrun)"
    )
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="epochal-elastic-") as tmp:
        results = {}
        elastic = ["--min-workers", str(args.nproc - 1)]
        seen: list[list[tuple[float, str]]] = []
        for name, extra, line in (
            ("elastic", elastic, "formed:"),
            ("restart-all", ["--max-restarts", "1"], "workers, backend"),
            ("replaced", [*elastic, "--max-restarts", "1"], "formed:"),
            ("torchrun", ["--max-restarts", "1"], "training epoch"),
        ):
            if args.only is not None and name not in args.only.split(","):
                continue
            torchrun = name == "torchrun"
            back, lost, bases, failed = [], [], [], []
            for _ in range(args.kills):
                # each trial beside an undisturbed run of its own: a shared machine's speed
                # drifts by more than a lost worker costs, so a loss is measured against the
                # run just before it
                base, _ = run(
                    rng, args.nproc, [], Path(tmp), kill=None, epochs=args.epochs, torchrun=torchrun
                )
                try:
                    wall, took = run(
                        rng,
                        args.nproc,
                        extra,
                        Path(tmp),
                        kill=line,
                        seen=seen if name == "replaced" else None,
                        epochs=args.epochs,
                        torchrun=torchrun,
                    )
                except RuntimeError as exc:
                    if not torchrun:
                        raise
                    # its restarted workers did not train: what they said last
                    errors = [
                        w
                        for w in str(exc).splitlines()
                        if "Error" in w and "ChildFailedError" not in w
                    ]
                    failed.append(errors[-1].strip() if errors else "no error said")
                    continue
                assert took is not None
                back.append(took)
                lost.append(wall - base)
                bases.append(base)
            if failed:
                print(
                    f"{name:12s} the restart failed in {len(failed)} of {args.kills} trials "
                    f"(the run ended without training again): {failed[-1]}",
                    flush=True,
                )
            if not back:
                continue
            results[name] = (statistics.median(back), statistics.median(lost))
            print(
                f"{name:12s} kill -> training again: median {statistics.median(back):.2f} s, "
                f"max {max(back):.2f} s; wall time lost: median {statistics.median(lost):.2f} s, "
                f"max {max(lost):.2f} s ({args.kills} kills; undisturbed "
                f"{'torchrun' if torchrun else 'epochal'} run, {args.nproc} workers, "
                f"{args.epochs} epochs: median {statistics.median(bases):.2f} s)",
                flush=True,
            )
        e_back, e_lost = results.get("elastic", (float("nan"), float("nan")))
        for other in ("restart-all", "torchrun"):
            if other not in results or "elastic" not in results:
                continue
            o_back, o_lost = results[other]
            # the time lost as a difference: the elastic run's is about nothing (or less, when
            # fewer workers share the cores better), so a ratio of the two would mean nothing
            print(
                f"{other} / elastic: {o_back / e_back:.1f}x to train again; "
                f"{o_lost - e_lost:.2f} s more wall time lost",
                flush=True,
            )
        joins = [f for f in map(join_figures, seen) if f is not None]
        if joins:
            waits, rates = [w for w, _ in joins], [r for _, r in joins]
            print(
                f"replacement: hello -> training at {args.nproc} workers median "
                f"{statistics.median(waits):.2f} s, max {max(waits):.2f} s; state taken at "
                f"median {statistics.median(rates) / 2**20:.1f} MiB/s "
                f"({len(joins)} of {len(seen)} replacements joined before the run ended)",
                flush=True,
            )
        elif seen:  # the replaced column ran, and no replacement joined
            print("replacement: none joined before the run ended: give it more epochs", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
