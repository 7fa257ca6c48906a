"""``epochal worker``: keep one worker process going on a machine of its own.

The supervisor runs the training command with ``EPOCHAL_COORDINATOR`` set, prefixes nothing (the
output is the worker's own), and when the command fails starts it again, up to ``--max-restarts``
times: a coordinator started with ``--max-restarts`` holds a new rendezvous after a failure and
resumes the run from its last committed checkpoint. An aborted run ends the worker with one line
saying why (``epochal: RunAborted: ...``; with ``--verbose``, the whole traceback). A worker that
gave up on an unreachable coordinator (status
:attr:`~epochal.errors.CoordinatorUnreachable.exit_code`) is not restarted: it would only wait
again. The child runs in its own process group and dies with the supervisor
(``PR_SET_PDEATHSIG`` on Linux); SIGINT and SIGTERM are passed on to it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType

from epochal.environment import COORDINATOR_ENV, VERBOSE_ENV, WORKER_ID_ENV
from epochal.errors import CoordinatorUnreachable
from epochal.launcher import _die_with_parent


def supervise(
    endpoint: str,
    command: Sequence[str],
    *,
    max_restarts: int = 0,
    restart_delay: float = 1.0,
    verbose: bool = False,
) -> int:
    """Run ``command`` as a worker of ``endpoint``; return the exit status to leave with.

    ``verbose`` sets ``EPOCHAL_VERBOSE=1`` for the worker: full tracebacks instead of the one line
    it prints for an error that stops the run.
    """
    env = dict(os.environ)
    env[COORDINATOR_ENV] = endpoint
    if verbose:
        env[VERBOSE_ENV] = "1"
    base_id = env.get(WORKER_ID_ENV) or f"{socket.gethostname()}/{os.getpid()}"
    child: subprocess.Popen[bytes] | None = None
    received: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        if child is not None and child.poll() is None:
            os.killpg(child.pid, signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for attempt in range(max_restarts + 1):
            env[WORKER_ID_ENV] = f"{base_id}/{attempt}"
            child = subprocess.Popen(
                list(command), env=env, start_new_session=True, preexec_fn=_die_with_parent
            )
            code = child.wait()
            try:
                os.killpg(child.pid, signal.SIGKILL)  # whatever it started goes with it
            except ProcessLookupError:
                pass
            if received:
                return 128 + received[0]
            if code == 0:
                return 0
            if code == CoordinatorUnreachable.exit_code:
                # the worker already waited its whole connect timeout: a restart would only
                # wait again, silently multiplying the time before the user hears of it
                _say(
                    f"the worker could not reach the coordinator at {endpoint}; not restarting "
                    "it: start the coordinator (or fix --connect), then run this again"
                )
                return code
            what = f"status {code}" if code > 0 else f"signal {signal.Signals(-code).name}"
            if attempt == max_restarts:
                if max_restarts:
                    _say(f"the worker failed ({what}); {max_restarts} restarts used up")
                return code if code > 0 else 128 - code
            _say(f"the worker failed ({what}); restart {attempt + 1} of {max_restarts}")
            time.sleep(restart_delay)
        return 1  # pragma: no cover - the loop always returns
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _say(line: str) -> None:
    print(f"epochal worker: {line}", file=sys.stderr, flush=True)
