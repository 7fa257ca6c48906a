"""What importing torch once saves: ``epochal run`` with its workers forked from one preloaded
process (the default) against each worker importing torch itself (``EPOCHAL_PRELOAD=none``).

    python bench/preload.py [--nproc 4] [--repeats 3] [--check]

Each run is ``epochal run --nproc N --epochs 2`` of ``train_epochal.py`` on a small workload
(1,024 samples), so that starting the processes is most of what it costs. Both variants run
``--repeats`` times, alternating and swapping which goes first every repeat. For each run the
report gives the CPU time of the launcher and every process under it (its reaped descendants'
``ru_utime + ru_stime``: the preloaded process reaps the workers and rank 0's store server, a
worker its own children), the wall time from spawning the launcher to its exit, and rank 0's
launch to first training step (``workload.Timings``). Then the medians' ratios, preloaded / fresh:

- CPU of the whole run: target <= 0.6 at 4 workers (N fresh imports of torch become one);
- launch to the first training step: target <= 1.0.

Exit status: 0 when every run succeeded (1 with ``--check`` when a target is missed), 1 when a run
failed (its output is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launchers import epochal_run_command, launch_env

BENCH = Path(__file__).resolve().parent
CPU_TARGET = 0.6
STARTUP_TARGET = 1.0
VARIANTS = {"fresh": "none", "preloaded": None}
WORKLOAD = ["--samples", "1024", "--valid-samples", "256"]


def run_once(variant: str, nproc: int, work: Path) -> dict[str, float]:
    """One ``epochal run``: its CPU (launcher and every descendant it reaped), wall time, and
    rank 0's launch to first step."""
    out = work / f"{variant}-{time.monotonic_ns()}.json"
    env = launch_env()
    if VARIANTS[variant] is not None:
        env["EPOCHAL_PRELOAD"] = VARIANTS[variant]
    command = epochal_run_command(
        nproc,
        2,
        work / out.stem,
        "--checkpoint-every",
        "0",
        str(BENCH / "train_epochal.py"),
        "--out",
        str(out),
        *WORKLOAD,
    )
    launched = time.time()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    ended = time.time()
    if os.waitstatus_to_exitcode(status) != 0:
        sys.stdout.write(output.decode(errors="replace"))
        raise SystemExit(f"{variant}: epochal run exited {os.waitstatus_to_exitcode(status)}")
    timings = json.loads(out.read_text())
    return {
        "cpu": usage.ru_utime + usage.ru_stime,
        "wall": ended - launched,
        "startup": timings["first_step"] - launched,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="epochal-preload-") as tmp:
        work = Path(tmp)
        run_once("preloaded", args.nproc, work)  # warm the file cache, untimed
        for repeat in range(args.repeats):
            order = list(VARIANTS) if repeat % 2 == 0 else list(reversed(VARIANTS))
            for variant in order:
                result = run_once(variant, args.nproc, work)
                results[variant].append(result)
                print(
                    f"{variant:>9}  cpu {result['cpu']:6.2f} s  wall {result['wall']:6.2f} s  "
                    f"launch to first step {result['startup']:6.2f} s",
                    flush=True,
                )
    medians = {
        variant: {key: statistics.median(r[key] for r in runs) for key in ("cpu", "startup")}
        for variant, runs in results.items()
    }
    cpu = medians["preloaded"]["cpu"] / medians["fresh"]["cpu"]
    startup = medians["preloaded"]["startup"] / medians["fresh"]["startup"]
    print(f"\n{args.nproc} workers, medians of {args.repeats} runs each, preloaded / fresh:")
    print(f"  CPU of the whole run            {cpu:.3f}  (target <= {CPU_TARGET})")
    print(f"  launch to the first step        {startup:.3f}  (target <= {STARTUP_TARGET})")
    missed = cpu > CPU_TARGET or startup > STARTUP_TARGET
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
