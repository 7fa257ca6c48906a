"""How fast a failure ends a run, and how fast a restart gets it training again.

    python bench/faults.py [--kills 20] [--nproc 3] [--seed 0]

For each of ``--kills`` trials it starts ``epochal run`` on the resume test's workload, waits a
random moment into training, SIGKILLs a random worker and measures the time until every process
of the run (launcher, workers, their children) is gone. Then the same with ``--max-restarts 1``:
the time from the kill until the restarted coordinator has welcomed a full set of new workers
(training resumes right after they load the checkpoint). Prints median and maximum of each.
Defaults apply: heartbeats on, abort grace 2 s.
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

from launchers import epochal_run_command, launch_env

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "integration" / "scripts" / "resumable.py"
MARK = "EPOCHAL_BENCH_MARK"


def marked(mark: str) -> list[int]:
    needle = f"{MARK}={mark}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state != "Z":
                        pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def worker_pids(mark: str) -> list[int]:
    """The workers: the run's processes whose command line starts the script. A worker forked
    from the preloaded process shows the command line it would have had (setproctitle), while
    its /proc environ stays the preloaded process's, without its rank; the launcher has the
    script on its command line too, after ``-m epochal run``."""
    script = str(SCRIPT).encode()
    pids = []
    for pid in marked(mark):
        try:
            line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        before, found, _ = line.partition(script)
        if found and b"-m epochal" not in before:
            pids.append(pid)
    return pids


def trial(rng: random.Random, nproc: int, restarts: bool, tmp: Path) -> float:
    mark = uuid.uuid4().hex
    env = {**launch_env(), MARK: mark, "PYTHONUNBUFFERED": "1"}
    run_dir = tmp / mark
    cmd = epochal_run_command(nproc, 6, run_dir)
    if restarts:
        cmd += ["--max-restarts", "1"]
    cmd += [str(SCRIPT), "--out", str(run_dir / "out"), "--delay", "0.02"]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    while not any("epoch 0 [" in line for line in lines):
        if proc.poll() is not None:
            raise RuntimeError("".join(lines))
        time.sleep(0.02)
    time.sleep(rng.uniform(0.0, 0.8))
    victim = rng.choice(worker_pids(mark))
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    try:
        if restarts:
            welcomed = sum("workers, backend" in line for line in lines)
            while sum("workers, backend" in line for line in lines) <= welcomed:
                if proc.poll() is not None:
                    raise RuntimeError("".join(lines))
                time.sleep(0.01)
            took = time.monotonic() - killed
            proc.wait(timeout=120)
            return took
        proc.wait(timeout=120)
        while marked(mark):
            time.sleep(0.01)
        return time.monotonic() - killed
    finally:
        for pid in marked(mark):
            os.kill(pid, signal.SIGKILL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="epochal-faults-") as tmp:
        for restarts, what in (
            (False, "kill -> every process stopped"),
            (True, "kill -> new workers welcomed (restart)"),
        ):
            times = [trial(rng, args.nproc, restarts, Path(tmp)) for _ in range(args.kills)]
            print(
                f"{what:40s} median {statistics.median(times):.2f} s, max {max(times):.2f} s "
                f"({len(times)} kills, {args.nproc} workers)",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
