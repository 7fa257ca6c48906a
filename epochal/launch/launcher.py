"""``epochal run``: an in-process coordinator plus N local worker processes running a script.

The launcher starts the coordinator on loopback port 0, starts each worker with
``EPOCHAL_COORDINATOR`` pointing at it and ``EPOCHAL_RANK`` (and torchrun's ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``) set, prefixes every line a worker prints with
its rank (:mod:`epochal.output` hides the noise that follows an abort), and ends with status 0
only when the run finished and every worker exited cleanly. The workers of a finished run exit in
their own time; those of an aborted run get ``abort_grace`` plus a margin. A worker that dies early
aborts the run for the others; whatever happens, no worker process outlives the launcher (each
runs in its own process group, killed at the end).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from epochal.coordinator import Coordinator, CoordinatorConfig
from epochal.environment import ABORT_GRACE_ENV, DEFAULT_ABORT_GRACE, env_seconds
from epochal.launch.attempt import EXIT_OK, Attempt, say
from epochal.launch.preload import Preload, preload_modules, worker_threads
from epochal.launch.rerun import FIX_LINE
from epochal.launch.restarts import Outcome, restarting
from epochal.log import COORDINATOR, child_environment, ensure_configured
from epochal.observe import RunObserver
from epochal.observe import watching as observe_options
from epochal.text import counted

EXIT_MARGIN = 10.0
"""Seconds, on top of ``abort_grace``, an aborted worker gets to shut its interpreter down (garbage
collection alone took up to 11 s on a loaded 2-core machine). Only an aborted or interrupted run
is bounded: the workers of a finished run exit in their own time, their own post-training work
included, unless ``--exit-timeout`` says otherwise."""
ABORT_EXIT_TIMEOUT = DEFAULT_ABORT_GRACE + EXIT_MARGIN
"""How long the launcher waits for the workers of an aborted run before it kills them, where
``EPOCHAL_ABORT_GRACE`` (which the workers inherit) is not set: :func:`abort_exit_timeout`."""


def abort_exit_timeout(environ: Mapping[str, str] | None = None) -> float:
    """How long the launcher waits for the workers of an aborted run before it kills them: their
    ``abort_grace`` (``EPOCHAL_ABORT_GRACE`` in ``environ``, which they inherit, or its default)
    plus :data:`EXIT_MARGIN`."""
    environ = os.environ if environ is None else environ
    return env_seconds(environ, ABORT_GRACE_ENV, DEFAULT_ABORT_GRACE) + EXIT_MARGIN


def _coordinator_say(line: str) -> None:
    COORDINATOR.info(f"[epochal] {line}")


async def launch(
    config: CoordinatorConfig,
    nproc: int,
    command: list[str],
    *,
    out: TextIO = sys.stdout,
    run_id: str | None = None,
    fresh: bool = False,
    max_restarts: int = 0,
    verbose: bool = False,
    exit_timeout: float | None = None,
    observers: RunObserver | None = None,
    resume_command: str = "",
) -> int:
    """Run ``command`` (python, script, args) as ``nproc`` workers; return the exit status.

    After a failure, up to ``max_restarts`` times, the launcher starts a new coordinator on the
    same run directory (which resumes from the last committed checkpoint) and new workers.
    Once the run has finished, the workers exit in their own time; ``exit_timeout`` (seconds,
    default: no bound) kills those still running that long after the finish. ``verbose`` shows
    every line the workers print, also the noise that follows an abort, and has the workers
    print their full tracebacks (``EPOCHAL_VERBOSE=1``) where they would print one line.
    ``observers`` watch every attempt (see :func:`run_observed`, which makes and closes them).
    A run that ends unfinished (aborted, interrupted) says ``resume_command`` last, the command
    line that continues it; one stopped by a configuration or data error says what to fix
    instead (:data:`~epochal.launch.rerun.FIX_LINE`), since a resume would repeat the error.
    """
    ensure_configured()
    modules = preload_modules()  # a bad EPOCHAL_PRELOAD is said before anything starts
    if not config.token:
        # a job token of its own, only in the workers' environment: a local process that reads
        # the endpoint from run.json still cannot join the run or take a worker's place
        config = dataclasses.replace(config, token=secrets.token_urlsafe(32))

    outcomes: list[Outcome] = []
    preload = Preload(modules, command, _preload_environment())

    async def attempt(n: int) -> Outcome:
        coordinator = Coordinator(
            config,
            log=_coordinator_say,
            run_id=run_id if n == 0 else None,
            fresh=fresh and n == 0,
            observers=observers,
            attempt=n,
            workers_here=True,
        )
        outcome = await _attempt(
            coordinator,
            config,
            nproc,
            command,
            out,
            verbose=verbose,
            exit_timeout=exit_timeout,
            max_restarts=max_restarts,
            preload=preload,
        )
        outcomes.append(outcome)
        return outcome

    async def restart(n: int, failed: Outcome) -> None:
        say(f"restart {n} of {max_restarts}: resuming from the last checkpoint", logging.WARNING)

    def give_up(failed: Outcome) -> None:
        say(
            f"FAILED: {counted(max_restarts, 'restart')} used up; the last failure: "
            f"{failed.reason}",
            logging.ERROR,
        )

    try:
        status = await restarting(attempt, max_restarts, restart=restart, give_up=give_up)
    finally:
        preload.close()
    if outcomes and outcomes[-1].needs_fix:
        say(FIX_LINE, logging.ERROR)
    elif resume_command and outcomes and outcomes[-1].unfinished:
        say(f"to resume: {resume_command}", logging.WARNING)
    return status


def run_observed(config: CoordinatorConfig, nproc: int, command: list[str], **kwargs: Any) -> int:
    """``epochal run``: :func:`launch` (``kwargs`` are its keywords) with the observers the
    config asks for (status.json, curve.png, TensorBoard, metrics), one set for every attempt.
    They are made before the run, so a taken metrics port or a missing extra stops it before it
    starts, and closed after the event loop is gone: the learning curve is drawn there."""
    observers = observe_options.from_config(config)
    try:
        return asyncio.run(launch(config, nproc, command, observers=observers, **kwargs))
    finally:
        observers.close()


def _preload_environment() -> dict[str, str]:
    """The environment the workers' preloaded process imports torch in: the launcher's, the
    workers' log settings, and their ``OMP_NUM_THREADS`` default (read as torch is imported)."""
    return worker_threads({**os.environ, **child_environment()})


async def _attempt(
    coordinator: Coordinator,
    config: CoordinatorConfig,
    nproc: int,
    command: list[str],
    out: TextIO,
    *,
    verbose: bool,
    exit_timeout: float | None,
    max_restarts: int = 0,
    preload: Preload | None = None,
) -> Outcome:
    """One coordinator and one set of workers (:class:`~epochal.launch.attempt.Attempt`); a failed
    run's outcome asks for a retry (the workers failing after the run finished, or a signal, do
    not)."""
    abort_exit = abort_exit_timeout()  # a bad EPOCHAL_ABORT_GRACE is said before anything starts
    endpoint = await coordinator.start()
    if coordinator.finished is not None:
        await coordinator.run()  # says that there is nothing to do
        return Outcome(EXIT_OK)
    where = "" if config.run_dir is None else f", in {config.run_dir}"
    say(
        f"{coordinator.attempt.named}{where}, coordinator at {endpoint}; "
        f"starting {counted(nproc, 'worker')}",
        logging.INFO,
    )
    attempt = Attempt(
        coordinator,
        config,
        nproc,
        command,
        out,
        endpoint=endpoint,
        verbose=verbose,
        exit_timeout=exit_timeout,
        abort_exit=abort_exit,
        max_restarts=max_restarts,
    )
    return await attempt.run(preload)


def script_command(script: str, args: list[str], *, module: bool = False) -> list[str]:
    """The command line that runs ``script`` (or ``-m module``) with this Python."""
    if module:
        return [sys.executable, "-u", "-m", script, *args]
    if not Path(script).is_file():
        raise FileNotFoundError(f"no such script: {script}")
    return [sys.executable, "-u", script, *args]
