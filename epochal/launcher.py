"""``epochal run``: an in-process coordinator plus N local worker processes running a script.

The launcher starts the coordinator on loopback port 0, starts each worker with
``EPOCHAL_COORDINATOR`` pointing at it and ``EPOCHAL_RANK`` set to its index, prefixes every line a
worker prints with its rank, and ends with status 0 only when the run finished and every worker
exited cleanly. A worker that dies early aborts the run for the others; whatever happens, no
worker process outlives the launcher (each runs in its own process group, killed at the end).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from epochal.coordinator import Coordinator, CoordinatorConfig, RunSummary
from epochal.environment import (
    COORDINATOR_ENV,
    JOB_ENV,
    LOCAL_RANK_ENV,
    PROGRESS_ENV,
    RANK_ENV,
    REATTACH_TIMEOUT_ENV,
    TOKEN_ENV,
    WORKER_ID_ENV,
    WORLD_SIZE_ENV,
)
from epochal.errors import RunAborted

EXIT_OK = 0
EXIT_FAILED = 1
KILL_GRACE = 3.0
"""Seconds workers get to leave on their own after the run ends, before they are killed."""

PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal a child gets when its parent dies (Linux)."""


class _Prefixer:
    """Copies a worker's output to ``out`` line by line, each line prefixed with its rank.

    Carriage returns (progress bars) are kept, so a bar redraws in place on a terminal.
    """

    def __init__(self, prefix: str, out: TextIO) -> None:
        self.prefix = prefix
        self.out = out
        self.pending = ""

    def feed(self, text: str) -> None:
        self.pending += text
        while True:
            cut = min(
                (i for i in (self.pending.find("\n"), self.pending.find("\r")) if i >= 0),
                default=-1,
            )
            if cut < 0:
                return
            line, end = self.pending[:cut], self.pending[cut]
            self.pending = self.pending[cut + 1 :]
            if line or end == "\n":
                self.out.write(f"{self.prefix}{line}{end}")
                self.out.flush()

    def close(self) -> None:
        if self.pending:
            self.out.write(f"{self.prefix}{self.pending}\n")
            self.out.flush()
            self.pending = ""


async def _pump(stream: asyncio.StreamReader, prefixer: _Prefixer) -> None:
    while chunk := await stream.read(65536):
        prefixer.feed(chunk.decode(errors="replace"))
    prefixer.close()


def _kill_group(proc: asyncio.subprocess.Process, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL it when the launcher dies, however the launcher dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the process-group kill at exit still applies
        pass


async def launch(
    config: CoordinatorConfig,
    nproc: int,
    command: list[str],
    *,
    out: TextIO = sys.stdout,
    log: Callable[[str], None] | None = None,
    run_id: str | None = None,
    fresh: bool = False,
    max_restarts: int = 0,
) -> int:
    """Run ``command`` (python, script, args) as ``nproc`` workers; return the exit status.

    After a failure, up to ``max_restarts`` times, the launcher starts a new coordinator on the
    same run directory (which resumes from the last committed checkpoint) and new workers.
    """
    say = log or (lambda line: print(f"[epochal] {line}", file=sys.stderr, flush=True))
    reasons: list[str] = []
    for attempt in range(max_restarts + 1):
        coordinator = Coordinator(
            config, log=say, run_id=run_id if attempt == 0 else None, fresh=fresh and attempt == 0
        )
        status, reason = await _attempt(coordinator, config, nproc, command, out, say)
        if status != EXIT_FAILED:
            return status
        reasons.append(reason)
        if attempt < max_restarts:
            say(f"restart {attempt + 1} of {max_restarts}: resuming from the last checkpoint")
    if max_restarts:
        say(f"FAILED: {max_restarts} restarts used up; the last failure: {reasons[-1]}")
    return EXIT_FAILED


async def _attempt(
    coordinator: Coordinator,
    config: CoordinatorConfig,
    nproc: int,
    command: list[str],
    out: TextIO,
    say: Callable[[str], None],
) -> tuple[int, str]:
    """One coordinator and one set of workers; (exit status, failure reason)."""
    endpoint = await coordinator.start()
    if coordinator.finished is not None:
        await coordinator.run()  # says that there is nothing to do
        return EXIT_OK, ""
    say(f"coordinator at {endpoint}, run {coordinator.run_id}; starting {nproc} workers")

    env_base = dict(os.environ)
    env_base[COORDINATOR_ENV] = endpoint
    env_base[JOB_ENV] = config.job
    env_base[WORLD_SIZE_ENV] = str(nproc)  # not a Slurm/torchrun world this may run inside
    env_base[REATTACH_TIMEOUT_ENV] = "0"  # this coordinator dies with the launcher: stop at once
    if config.token:
        env_base[TOKEN_ENV] = config.token
    env_base.setdefault("PYTHONUNBUFFERED", "1")
    env_base.setdefault("OMP_NUM_THREADS", "1")  # N workers on one machine: don't oversubscribe
    if out.isatty():
        env_base.setdefault(PROGRESS_ENV, "1")

    procs: list[asyncio.subprocess.Process] = []
    pumps: list[asyncio.Task[None]] = []
    width = len(str(nproc - 1))
    for index in range(nproc):
        env = dict(env_base)
        env[RANK_ENV] = str(index)
        env[LOCAL_RANK_ENV] = str(index)
        env[WORKER_ID_ENV] = f"{coordinator.run_id}/local-{index}"
        proc = await asyncio.create_subprocess_exec(
            *command,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        procs.append(proc)
        assert proc.stdout is not None
        pumps.append(
            asyncio.create_task(_pump(proc.stdout, _Prefixer(f"[rank {index:>{width}}] ", out)))
        )

    interrupted: list[str] = []

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        interrupted.append(name)
        coordinator.abort(f"the launcher received {name}")
        for p in procs:
            _kill_group(p, signum)

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)

    async def watch(index: int, proc: asyncio.subprocess.Process) -> int:
        code = await proc.wait()
        if coordinator.phase.value not in ("finishing", "ended"):
            what = (
                f"exited with status {code}"
                if code >= 0
                else f"was killed by {signal.Signals(-code).name}"
            )
            coordinator.report_failure(
                f"worker {index} (pid {proc.pid}) {what} before the run finished", cause=True
            )
        return code

    watchers = [asyncio.create_task(watch(i, p)) for i, p in enumerate(procs)]
    summary: RunSummary | None = None
    reason = ""
    try:
        summary = await coordinator.run()
    except RunAborted as exc:
        reason = exc.reason
    finally:
        _, pending = await asyncio.wait(watchers, timeout=KILL_GRACE)
        for p in procs:
            if p.returncode is None:
                _kill_group(p, signal.SIGKILL)
        codes = [await w for w in watchers]
        for p in procs:  # the workers' children (data loader workers) go too
            _kill_group(p, signal.SIGKILL)
        await asyncio.gather(*pumps, return_exceptions=True)
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    if pending:
        say(f"{len(pending)} workers did not exit within {KILL_GRACE:g} s and were killed")
    if interrupted:
        say(f"interrupted by {interrupted[0]}")
        return 128 + int(getattr(signal, interrupted[0])), reason
    if summary is None:
        say(f"FAILED: {reason}")
        return EXIT_FAILED, reason
    bad = [(i, c) for i, c in enumerate(codes) if c != 0]
    if bad:
        listed = ", ".join(f"worker {i}: status {c}" for i, c in bad)
        say(f"FAILED: the run finished but workers exited non-zero ({listed})")
        return EXIT_FAILED, f"workers exited non-zero ({listed})"
    say(f"done: best epoch {summary.best_epoch} of {summary.epochs_run}")
    return EXIT_OK, ""


def script_command(script: str, args: list[str], *, module: bool = False) -> list[str]:
    """The command line that runs ``script`` (or ``-m module``) with this Python."""
    if module:
        return [sys.executable, "-u", "-m", script, *args]
    if not Path(script).is_file():
        raise FileNotFoundError(f"no such script: {script}")
    return [sys.executable, "-u", script, *args]
