"""``epochal coordinator``: the coordinator served as a long-lived service.

It binds, prints the address it listens on (and writes it to ``--address-file``), tells how
workers attach, and serves the run; after an aborted run it serves again on the same address and
run directory, up to ``--max-restarts`` times, through the one restart loop of
:mod:`epochal.launch.restarts`. A bug in the coordinator itself exits :data:`EXIT_CRASH`, which a
supervisor (systemd, Kubernetes) restarts and which resumes the run.
"""

from __future__ import annotations

import asyncio
import signal
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from epochal.coordinator.config import CoordinatorConfig
from epochal.coordinator.serve.attach import attach_hint, local_address
from epochal.coordinator.serve.service import Coordinator
from epochal.errors import ConfigError, RunAborted
from epochal.launch.rerun import FIX_LINE
from epochal.launch.restarts import Outcome, restarting
from epochal.log import COORDINATOR
from epochal.observe import RunObserver
from epochal.observe import watching as observe_options
from epochal.rundir import addressfile
from epochal.security.curvekeys import ServerSecurity
from epochal.text import counted

EXIT_CRASH = 70
"""The coordinator itself failed (EX_SOFTWARE): unlike an abort (1), worth restarting."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeOptions:
    """How ``epochal coordinator`` serves a run (not settings of the run itself)."""

    bind: str
    # the ZeroMQ endpoint to listen on
    fresh: bool = False
    # discard what the run directory holds and start over
    max_restarts: int = 0
    # after an aborted run, serve again on the same address this many times
    address_file: Path | None = None
    # write the address workers connect to here, and remove it at exit
    curve_key: Path | None = None
    # the coordinator's secret key file (named in the attach hint)
    curve_allowed: Path | None = None
    # the allow-list directory (named in the attach hint)
    resume_command: str = ""
    # the command line that continues the run, said last when it ends unfinished; "": none


async def _serve(
    config: CoordinatorConfig,
    options: ServeOptions,
    run_id: str,
    security: ServerSecurity | None,
    observers: RunObserver,
) -> int:
    coordinator = Coordinator(
        config,
        bind=options.bind,
        run_id=run_id,
        fresh=options.fresh,
        security=security,
        log=COORDINATOR.info,
        observers=observers,
    )
    endpoint = await coordinator.start()
    print(f"epochal coordinator listening on {endpoint}", flush=True)
    if config.run_dir is not None:
        COORDINATOR.info(f"epochal: {coordinator.attempt.named}, in {config.run_dir}")
    written: str | None = None
    address_file = options.address_file
    if address_file is not None:
        written = addressfile.connectable(endpoint)
        addressfile.write(address_file, written)
        print(f"epochal coordinator address {written} written to {address_file}", flush=True)
        attach = f"file:{address_file}"
    else:
        attach = endpoint  # a wildcard host is replaced by this machine's address in the hint
    COORDINATOR.info(
        attach_hint(
            attach,
            address=local_address(),
            server_secret_key=options.curve_key,
            allowed_dir=options.curve_allowed,
        )
    )
    try:
        return await _serve_runs(config, options, coordinator, endpoint, security, observers)
    finally:
        if address_file is not None and written is not None:
            addressfile.remove_if_ours(address_file, written)


async def _serve_runs(
    config: CoordinatorConfig,
    options: ServeOptions,
    coordinator: Coordinator,
    endpoint: str,
    security: ServerSecurity | None,
    observers: RunObserver,
) -> int:
    """Serve runs at ``endpoint``: after an aborted one, up to ``--max-restarts`` times, a new
    coordinator on the same address and run directory waits for the workers to come back."""
    received: list[int] = []

    def on_signal(signum: int) -> None:
        received.append(signum)
        coordinator.abort(f"the coordinator received {signal.Signals(signum).name}")

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)

    async def attempt(n: int) -> Outcome:
        if received:  # a signal while the coordinator was started again
            return Outcome(128 + received[0])
        try:
            await coordinator.run()
            return Outcome(0)
        except RunAborted as exc:
            if received:
                return Outcome(128 + received[0])
            if exc.needs_fix:  # a restart would stop on the same error
                return Outcome(1, exc.reason, needs_fix=True)
            return Outcome(1, exc.reason, retry=True)

    async def restart(n: int, failed: Outcome) -> None:
        nonlocal coordinator
        coordinator.log(
            f"restart {n} of {options.max_restarts}: waiting at {endpoint} for the "
            "workers to come back; the run resumes from its last committed checkpoint"
        )
        coordinator = Coordinator(
            config,
            bind=endpoint,
            security=security,
            log=COORDINATOR.info,
            observers=observers,
            attempt=n,
        )
        await _start_again(coordinator)

    def give_up(failed: Outcome) -> None:
        coordinator.log(f"FAILED: {counted(options.max_restarts, 'restart')} used up")

    outcomes: list[Outcome] = []

    async def noted(n: int) -> Outcome:
        outcomes.append(await attempt(n))
        return outcomes[-1]

    status = await restarting(noted, options.max_restarts, restart=restart, give_up=give_up)
    if outcomes and outcomes[-1].needs_fix:
        COORDINATOR.error(FIX_LINE)
    elif status != 0 and coordinator.finished is None:
        say_how_to_resume(COORDINATOR.warning, options.resume_command)
    return status


def say_how_to_resume(log: Callable[[str], None], command: str) -> None:
    """The last line of a run that ended unfinished: the command that continues it."""
    if command:
        log(f"to resume: {command}")


async def _start_again(coordinator: Coordinator) -> None:
    """Bind the same address again; the old socket may take a moment to let it go."""
    for _ in range(50):
        try:
            await coordinator.start()
            return
        except OSError:
            await asyncio.sleep(0.1)
    await coordinator.start()


def serve_or_crash(
    config: CoordinatorConfig,
    options: ServeOptions,
    run_id: str,
    security: ServerSecurity | None,
) -> int:
    """Serve; a bug in the coordinator itself exits EXIT_CRASH, which a supervisor restarts.

    The observers the options ask for (status.json, curve.png, TensorBoard, metrics) watch every
    attempt; they are closed once the event loop is gone (the curve is drawn then)."""
    observers = observe_options.from_config(config)
    try:
        return asyncio.run(_serve(config, options, run_id, security, observers))
    except (ConfigError, OSError, KeyboardInterrupt):
        raise
    except Exception:
        COORDINATOR.error(traceback.format_exc().rstrip("\n"))
        COORDINATOR.error(
            f"epochal: the coordinator crashed (exit status {EXIT_CRASH}); the traceback above is "
            "a bug to report. Started again with the same --run-dir, it resumes the run"
        )
        say_how_to_resume(COORDINATOR.error, options.resume_command)
        return EXIT_CRASH
    finally:
        observers.close()
