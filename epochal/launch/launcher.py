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
import functools
import logging
import os
import secrets
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from epochal.coordinator import Coordinator, CoordinatorConfig, RunSummary
from epochal.environment import (
    ABORT_GRACE_ENV,
    COORDINATOR_ENV,
    DEFAULT_ABORT_GRACE,
    JOB_ENV,
    LOCAL_RANK_ENV,
    PROGRESS_ENV,
    RANK_ENV,
    REATTACH_TIMEOUT_ENV,
    TOKEN_ENV,
    VERBOSE_ENV,
    WORKER_ID_ENV,
    WORLD_SIZE_ENV,
    env_seconds,
)
from epochal.errors import EpochalError, RunAborted
from epochal.launch.plain import PLAIN_LINE, free_port, made_its_own_group, wait_plain
from epochal.launch.preload import Forked, Preload, preload_modules, worker_threads
from epochal.launch.processes import Child, die_with_parent, kill_group
from epochal.launch.rerun import FIX_LINE
from epochal.launch.restarts import Outcome, restarting
from epochal.log import COORDINATOR, LAUNCHER, child_environment, ensure_configured
from epochal.observe import RunObserver
from epochal.observe import options as observe_options
from epochal.output import RankStream, Relay
from epochal.text import counted, exit_words

EXIT_OK = 0
EXIT_FAILED = 1
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


NEVER_CALLED_HINT = (
    "; did the script call epochal.train() or epochal.join()? (an `if __name__ == "
    "'__main__':` guard around a function that is never called does this too)"
)


async def _pump(stream: asyncio.StreamReader, prefixer: RankStream) -> None:
    while chunk := await stream.read(65536):
        prefixer.feed(chunk.decode(errors="replace"))
    prefixer.close()


def _say(line: str, level: int) -> None:
    LAUNCHER.log(level, f"[epochal] {line}")


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
        _say(f"restart {n} of {max_restarts}: resuming from the last checkpoint", logging.WARNING)

    def give_up(failed: Outcome) -> None:
        _say(
            f"FAILED: {counted(max_restarts, 'restart')} used up; the last failure: "
            f"{failed.reason}",
            logging.ERROR,
        )

    try:
        status = await restarting(attempt, max_restarts, restart=restart, give_up=give_up)
    finally:
        preload.close()
    if outcomes and outcomes[-1].needs_fix:
        _say(FIX_LINE, logging.ERROR)
    elif resume_command and outcomes and outcomes[-1].unfinished:
        _say(f"to resume: {resume_command}", logging.WARNING)
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


def worker_environment(
    base: dict[str, str], index: int, nproc: int, worker_id: str, master_port: int
) -> dict[str, str]:
    """The environment of local worker ``index`` of ``nproc``: epochal's variables, and
    torchrun's (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``) so that a script written for torchrun runs unchanged (see
    :mod:`epochal.launch.plain`)."""
    env = dict(base)
    env[RANK_ENV] = str(index)
    env[LOCAL_RANK_ENV] = str(index)
    env[WORKER_ID_ENV] = worker_id
    env["RANK"] = env["LOCAL_RANK"] = str(index)
    env["WORLD_SIZE"] = env["LOCAL_WORLD_SIZE"] = str(nproc)
    env["GROUP_RANK"] = "0"
    env["MASTER_ADDR"] = "127.0.0.1"
    env["MASTER_PORT"] = str(master_port)
    return env


async def _wait_for_exit(
    watchers: list[asyncio.Task[int]],
    bound: float | None,
    interrupted: list[str],
    abort_exit: float,
) -> None:
    """Wait for every worker to exit, at most ``bound`` seconds (None: no bound); a signal
    received meanwhile bounds the wait to ``abort_exit`` (:func:`abort_exit_timeout`) from then
    on."""
    loop = asyncio.get_running_loop()
    deadline = None if bound is None else loop.time() + bound
    signalled_at: float | None = None
    while pending := [w for w in watchers if not w.done()]:
        if interrupted and signalled_at is None:
            signalled_at = loop.time()
            limit = signalled_at + abort_exit
            deadline = limit if deadline is None else min(deadline, limit)
        step = 0.5
        if deadline is not None:
            step = min(step, deadline - loop.time())
            if step <= 0:
                return
        await asyncio.wait(pending, timeout=step)


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
    """One coordinator and one set of workers; a failed run's outcome asks for a retry (the
    workers failing after the run finished, or a signal, do not)."""
    abort_exit = abort_exit_timeout()  # a bad EPOCHAL_ABORT_GRACE is said before anything starts
    endpoint = await coordinator.start()
    if coordinator.finished is not None:
        await coordinator.run()  # says that there is nothing to do
        return Outcome(EXIT_OK)
    where = "" if config.run_dir is None else f" in {config.run_dir}"
    _say(
        f"run {coordinator.run_id}{where}, coordinator at {endpoint}; "
        f"starting {counted(nproc, 'worker')}",
        logging.INFO,
    )

    env_base = dict(os.environ)
    env_base[COORDINATOR_ENV] = endpoint
    env_base[JOB_ENV] = config.job
    env_base[WORLD_SIZE_ENV] = str(nproc)  # not a Slurm/torchrun world this may run inside
    env_base[REATTACH_TIMEOUT_ENV] = "0"  # this coordinator dies with the launcher: stop at once
    if config.token:
        env_base[TOKEN_ENV] = config.token
    env_base.update(child_environment())  # the workers log as the launcher does
    env_base.setdefault("PYTHONUNBUFFERED", "1")
    env_base = worker_threads(env_base)  # N workers on one machine: don't oversubscribe
    if out.isatty():
        env_base.setdefault(PROGRESS_ENV, "1")
    if verbose:
        env_base[VERBOSE_ENV] = "1"  # the workers keep their tracebacks too

    master_port = free_port()  # for a script that makes its own process group (torchrun's)
    relay = Relay(out, verbose=verbose)
    procs: list[Child] = []
    pumps: list[asyncio.Task[None]] = []
    slots: list[int] = []
    # the worker index each process stands for (a replacement takes its lost worker's)
    width = len(str(nproc - 1))

    def failed() -> None:
        _say(
            "the process that imports torch once for every worker has ended (its error, if it "
            "had one, is above): each worker imports torch itself from now on",
            logging.WARNING,
        )

    preloaded = (
        None
        if preload is None
        else await preload.get(failed, said=lambda line: _say(line, logging.INFO))
    )

    async def start(index: int, worker_id: str) -> Child:
        nonlocal preloaded
        env = worker_environment(env_base, index, nproc, worker_id, master_port)
        proc: asyncio.subprocess.Process | Forked | None = None
        if preloaded is not None:
            try:
                proc = await preloaded.spawn(command, env)
            except EpochalError as exc:  # it ended meanwhile (killed, say)
                _say(
                    f"{exc}: worker {index} and those after it import torch themselves",
                    logging.WARNING,
                )
                preloaded = None
        if proc is None:
            proc = await asyncio.create_subprocess_exec(
                *command,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=functools.partial(die_with_parent, os.getpid()),
            )
        procs.append(proc)
        slots.append(index)
        assert proc.stdout is not None
        pumps.append(
            asyncio.create_task(
                _pump(proc.stdout, relay.stream(f"[rank {index:>{width}}] ", rank=index))
            )
        )
        return proc

    for index in range(nproc):
        await start(index, f"{coordinator.run_id}/local-{index}")

    interrupted: list[str] = []

    def on_signal(signum: int) -> None:
        if interrupted:  # a second Ctrl-C: stop waiting for anyone
            for p in procs:
                kill_group(p.pid, signal.SIGKILL)
            return
        name = signal.Signals(signum).name
        interrupted.append(name)
        relay.stop()
        coordinator.abort(f"the launcher received {name}")
        for p in procs:
            kill_group(p.pid, signum)

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)

    async def watch(position: int, proc: Child) -> int:
        code = await proc.wait()
        phase = coordinator.phase.value
        index = slots[position]
        if plain:
            pass  # the launcher alone watches a plain run's workers (wait_plain)
        elif phase not in ("finishing", "ended"):
            what = exit_words(code)
            hint = NEVER_CALLED_HINT if code == 0 and phase == "rendezvous" else ""
            failure = f"worker {index} (pid {proc.pid}) {what} before the run finished{hint}"
            if coordinator.worker_exited(proc.pid, what, failure):
                lost.append(position)  # the others carry on without it
                if len(replaced) < spares and not interrupted:
                    replaced.append(position)
                    replacing.append(asyncio.create_task(replace(index, len(replaced), proc.pid)))
        elif code != 0 and coordinator.was_lost(proc.pid):
            lost.append(position)  # dropped from the run (frozen, say), and it ended after it
        return code

    async def replace(index: int, n: int, gone: int) -> None:
        """Start a replacement for lost worker ``index`` (process ``gone``): it joins at the next
        boundary. It is started once the coordinator has taken ``gone``'s rank out of the world
        (its connection closed with it: at once; at most ``heartbeat_timeout`` seconds): a
        replacement forked from the preloaded process says hello within milliseconds, and a
        hello while the world still counts the lost rank is refused as one worker too many."""
        deadline = loop.time() + config.heartbeat_timeout
        while coordinator.in_world(gone) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        worker_id = f"{coordinator.run_id}/local-{index}/{n}"
        proc = await start(index, worker_id)
        position = procs.index(proc)  # start() appended it
        spare_positions.append(position)
        _say(
            f"worker {index} lost: started {worker_id} (pid {proc.pid}) in its place, "
            f"replacement {n} of {spares}; it joins at the next epoch boundary",
            logging.INFO,
        )
        watchers.append(asyncio.create_task(watch(position, proc)))

    spares = max_restarts if config.elastic else 0
    # an elastic run replaces lost workers, up to --max-restarts of them, instead of restarting
    replaced: list[int] = []
    replacing: list[asyncio.Task[None]] = []
    spare_positions: list[int] = []  # the processes started as replacements

    lost: list[int] = []
    # workers whose rank was lost while the others carried on (an elastic run)
    plain: list[bool] = []
    # [True] once the coordinator stood down for a script with a process group of its own
    failed_first: int | None = None  # in such a run, the worker that failed first

    async def stand_down() -> None:
        seen = await made_its_own_group(
            master_port, coordinator.heard_from_no_worker, [p.pid for p in procs]
        )
        if seen and coordinator.stand_down(PLAIN_LINE):
            plain.append(True)

    watchers = [asyncio.create_task(watch(i, p)) for i, p in enumerate(procs)]
    detector = asyncio.create_task(stand_down())
    summary: RunSummary | None = None
    reason = ""
    needs_fix = False
    try:
        summary = await coordinator.run()
        for position in spare_positions:
            proc = procs[position]
            if proc.returncode is None and not coordinator.in_world(proc.pid):
                # a replacement the run finished without (starting, or waiting for a boundary)
                lost.append(position)
                kill_group(proc.pid, signal.SIGTERM)
                _say(
                    f"worker {slots[position]}'s replacement (pid {proc.pid}) had not joined when "
                    "the run finished; stopped",
                    logging.INFO,
                )
        if plain:  # no bound: the script trains for as long as it does
            failed_first = await wait_plain(procs, watchers, abort_exit)
    except RunAborted as exc:
        reason, needs_fix = exc.reason, exc.needs_fix
        relay.stop()
        # still connecting when the rendezvous was aborted (another worker's model or --monitor,
        # say): nothing tells them, and they have nothing to keep
        running = [p.pid for p in procs if p.returncode is None]
        for pid in coordinator.never_joined(running):
            kill_group(pid, signal.SIGTERM)
    finally:
        detector.cancel()
        await asyncio.gather(*replacing, return_exceptions=True)
        bound = exit_timeout if summary is not None else abort_exit
        await _wait_for_exit(watchers, bound, interrupted, abort_exit)
        stuck = [i for i, p in enumerate(procs) if p.returncode is None]
        for i in stuck:
            kill_group(procs[i].pid, signal.SIGKILL)
        codes = [await w for w in watchers]
        for p in procs:  # the workers' children (data loader workers) go too
            kill_group(p.pid, signal.SIGKILL)
        await asyncio.gather(*pumps, return_exceptions=True)
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        relay.release(known_reasons=reason)
    if plain:
        return _plain_outcome(codes, failed_first, interrupted)
    hidden = hidden_note(relay.hidden)
    if interrupted and summary is not None:
        bound = abort_exit  # the signal bounded a wait that had none
    killed = (
        f"; {_workers([slots[i] for i in stuck])} still running {bound:g} s later and killed"
        if stuck
        else ""
    )
    if interrupted:
        when = " after the run finished (result.json says so)" if summary is not None else ""
        _say(f"interrupted by {interrupted[0]}{when}{killed}{hidden}", logging.WARNING)
        status = 128 + int(getattr(signal, interrupted[0]))
        return Outcome(status, reason, unfinished=summary is None)
    if summary is None:
        _say(f"FAILED: the run was aborted (the reason is above){killed}{hidden}", logging.ERROR)
        if needs_fix:  # a restart would stop on the same error
            return Outcome(EXIT_FAILED, reason, unfinished=True, needs_fix=True)
        return Outcome(EXIT_FAILED, reason, retry=True, unfinished=True)
    if stuck:
        _say(
            f"FAILED: the run finished (result.json says so), but "
            f"{_workers([slots[i] for i in stuck])} still "
            f"running {bound:g} s later (--exit-timeout) and killed",
            logging.ERROR,
        )
        return Outcome(EXIT_FAILED, "workers did not exit after the finish")
    bad = [(i, c) for i, c in enumerate(codes) if c != 0 and i not in lost]
    if bad:
        listed = ", ".join(f"worker {slots[i]}: status {c}" for i, c in bad)
        _say(
            "FAILED: the run finished (result.json says so), but the script failed after "
            f"epochal.train() returned ({listed})",
            logging.ERROR,
        )
        return Outcome(EXIT_FAILED, f"workers exited non-zero ({listed})")
    without = ""
    if lost:
        gone = sorted({slots[i] for i in lost if i not in spare_positions})
        back = sorted({slots[i] for i in spare_positions if i not in lost})
        listed = ", ".join(map(str, gone))
        what = "lost on the way"
        if back == gone:
            what = "lost and replaced"
        elif back:
            what += f"; worker{'s' if len(back) > 1 else ''} {', '.join(map(str, back))} replaced"
        without = f" (worker{'s' if len(gone) > 1 else ''} {listed} {what})"
    if summary.epochs_run == 0:  # join() for the process group only: the script's own loop
        _say(
            f"done: {counted(len(codes), 'worker')} closed their sessions and exited 0",
            logging.INFO,
        )
        return Outcome(EXIT_OK)
    _say(f"done: best epoch {summary.best_epoch} of {summary.epochs_run}{without}", logging.INFO)
    return Outcome(EXIT_OK)


def _plain_outcome(codes: list[int], first: int | None, interrupted: list[str]) -> Outcome:
    """How a plain run (a torchrun script, :mod:`epochal.launch.plain`) ended: finished when
    every worker exited 0; else ``first`` failed first."""
    if interrupted:
        _say(f"interrupted by {interrupted[0]}", logging.WARNING)
        return Outcome(128 + int(getattr(signal, interrupted[0])), "interrupted")
    if first is None:
        _say(f"done: {counted(len(codes), 'worker')} exited 0", logging.INFO)
        return Outcome(EXIT_OK)
    reason = f"worker {first} {exit_words(codes[first])}; the others were stopped"
    _say(f"FAILED: {reason}", logging.ERROR)
    return Outcome(EXIT_FAILED, reason, retry=True)


def hidden_note(hidden: int) -> str:
    """What the launcher's last line adds about the ``hidden`` lines of worker output."""
    if hidden == 0:
        return ""
    if hidden == 1:
        return "; 1 line of worker output that follows from it is hidden (--verbose shows it)"
    return (
        f"; {hidden} lines of worker output that follow from it are hidden (--verbose shows them)"
    )


def _workers(indices: list[int]) -> str:
    if len(indices) == 1:
        return f"worker {indices[0]} was"
    return f"workers {', '.join(map(str, indices))} were"


def script_command(script: str, args: list[str], *, module: bool = False) -> list[str]:
    """The command line that runs ``script`` (or ``-m module``) with this Python."""
    if module:
        return [sys.executable, "-u", "-m", script, *args]
    if not Path(script).is_file():
        raise FileNotFoundError(f"no such script: {script}")
    return [sys.executable, "-u", script, *args]
