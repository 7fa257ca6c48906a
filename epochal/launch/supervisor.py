"""``epochal worker``: keep one worker process going on a machine of its own.

The supervisor runs the training command with ``EPOCHAL_COORDINATOR`` set, prefixes nothing (the
output is the worker's own), and when the command fails starts it again, up to ``--max-restarts``
times: a coordinator started with ``--max-restarts`` holds a new rendezvous after a failure and
resumes the run from its last committed checkpoint. An aborted run ends the worker with one line
saying why (``epochal: RunAborted: ...``; with ``--verbose``, the whole traceback). A worker that
gave up on an unreachable coordinator (status
:attr:`~epochal.errors.CoordinatorUnreachable.exit_code`) is not restarted: it would only wait
again. The child runs in its own process group and dies with the supervisor
(``PR_SET_PDEATHSIG`` on Linux); SIGINT and SIGTERM are passed on to it, and one received while
the supervisor waits to restart the worker ends the supervisor instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence

from epochal.environment import COORDINATOR_ENV, VERBOSE_ENV, WORKER_ID_ENV
from epochal.errors import CoordinatorUnreachable
from epochal.launch.processes import die_with_parent, kill_group
from epochal.launch.restarts import Outcome, restarting
from epochal.log import LAUNCHER, child_environment, ensure_configured
from epochal.text import counted

SIGNALS = (signal.SIGINT, signal.SIGTERM)

PLAIN_MODULE = "epochal.worker.plain"
"""Runs a torchrun script as a worker (``epochal worker --torchrun``); started by name, since
the launcher does not import the worker's side."""


def supervise(
    endpoint: str,
    command: Sequence[str],
    *,
    max_restarts: int = 0,
    restart_delay: float = 1.0,
    verbose: bool = False,
    torchrun: bool = False,
) -> int:
    """Run ``command`` as a worker of ``endpoint``; return the exit status to leave with.

    ``verbose`` sets ``EPOCHAL_VERBOSE=1`` for the worker: full tracebacks instead of the one line
    it prints for an error that stops the run. ``torchrun``: ``command`` is a script written for
    torchrun, run by :mod:`epochal.worker.plain`, which joins the run for it.
    """
    if torchrun:
        command = [sys.executable, "-m", PLAIN_MODULE, "--", *command]
    ensure_configured()
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    try:
        return asyncio.run(
            _supervise(
                endpoint,
                command,
                max_restarts=max_restarts,
                restart_delay=restart_delay,
                verbose=verbose,
            )
        )
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


async def _supervise(
    endpoint: str,
    command: Sequence[str],
    *,
    max_restarts: int,
    restart_delay: float,
    verbose: bool,
) -> int:
    env = dict(os.environ)
    env[COORDINATOR_ENV] = endpoint
    env.update(child_environment())  # the worker logs as its supervisor does
    if verbose:
        env[VERBOSE_ENV] = "1"
    base_id = env.get(WORKER_ID_ENV) or f"{socket.gethostname()}/{os.getpid()}"
    child: asyncio.subprocess.Process | None = None
    received: list[int] = []
    signalled = asyncio.Event()  # cuts the restart delay short

    def forward(signum: int) -> None:
        received.append(signum)
        signalled.set()
        if child is not None and child.returncode is None:
            kill_group(child.pid, signum)

    loop = asyncio.get_running_loop()
    for s in SIGNALS:
        loop.add_signal_handler(s, forward, s)

    async def attempt(n: int) -> Outcome:
        nonlocal child
        if received:  # a signal during the restart delay: no worker to pass it on to
            return Outcome(128 + received[0])
        env[WORKER_ID_ENV] = f"{base_id}/{n}"
        child = await asyncio.create_subprocess_exec(
            *command, env=env, start_new_session=True, preexec_fn=die_with_parent
        )
        code = await child.wait()
        kill_group(child.pid, signal.SIGKILL)  # whatever it started goes with it
        if received:
            return Outcome(128 + received[0])
        if code == 0:
            return Outcome(0)
        if code == CoordinatorUnreachable.exit_code:
            # the worker already waited its whole connect timeout: a restart would only
            # wait again, silently multiplying the time before the user hears of it
            _say(
                f"the worker could not reach the coordinator at {endpoint}; not restarting "
                "it: start the coordinator (or fix --connect), then run this again",
                logging.ERROR,
            )
            return Outcome(code)
        what = f"status {code}" if code > 0 else f"signal {signal.Signals(-code).name}"
        return Outcome(code if code > 0 else 128 - code, what, retry=True)

    async def restart(n: int, failed: Outcome) -> None:
        _say(f"the worker failed ({failed.reason}); restart {n} of {max_restarts}", logging.WARNING)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(signalled.wait(), restart_delay)

    def give_up(failed: Outcome) -> None:
        used = counted(max_restarts, "restart")
        _say(f"the worker failed ({failed.reason}); {used} used up", logging.ERROR)

    return await restarting(attempt, max_restarts, restart=restart, give_up=give_up)


def _say(line: str, level: int) -> None:
    LAUNCHER.log(level, f"epochal worker: {line}")
