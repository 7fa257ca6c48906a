"""A coordinator inside the caller's process: for notebooks and for users' own tests.

:func:`start_coordinator` runs a :class:`~epochal.coordinator.serve.service.Coordinator` on a daemon
thread with its own asyncio loop and ZeroMQ context, so the caller's thread stays free (to start
worker processes, or to train in a notebook cell). Everything that crosses threads goes through
the loop (``call_soon_threadsafe``) or is read after the thread ended; the outcome (a summary, a
RunAborted, or an unexpected error) is recorded on the thread and raised by :meth:`wait`, never
into a random thread.

::

    with epochal.start_coordinator(world_size=2, epochs=5) as coordinator:
        start_workers(coordinator.endpoint)     # EPOCHAL_COORDINATOR=coordinator.endpoint
        summary = coordinator.wait()            # RunSummary, or raises RunAborted
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from types import TracebackType
from typing import Any

import zmq.asyncio

from epochal.coordinator.config import CoordinatorConfig
from epochal.coordinator.serve.service import Coordinator, RunSummary
from epochal.errors import ConfigError, RunAborted
from epochal.observe import RunObserver
from epochal.observe import watching as observe_options
from epochal.security.curvekeys import ServerSecurity

_PATH_OPTIONS = ("run_dir", "checkpoint_dir")


class BackgroundCoordinator:
    """A coordinator serving one run on a thread of this process; see :func:`start_coordinator`."""

    def __init__(
        self,
        config: CoordinatorConfig,
        *,
        bind: str,
        security: ServerSecurity | None,
        fresh: bool,
        run_id: str | None,
        log: Callable[[str], None] | None,
        observers: RunObserver | None = None,
    ) -> None:
        self.config = config
        self._own_observers = observers is None
        # built here from the config (and closed when the run is over), or the caller's
        self._observers = observe_options.from_config(config) if observers is None else observers
        self._bind = bind
        self._security = security
        self._fresh = fresh
        self._run_id = run_id
        self._log = log
        self._thread = threading.Thread(target=self._serve, name="epochal-coordinator", daemon=True)
        self._bound = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._coordinator: Coordinator | None = None
        self._outcome: RunSummary | BaseException | None = None

    # ------------------------------------------------------------------ the thread

    def _serve(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # recorded here, raised by wait() in the caller's thread
            self._outcome = exc
        finally:
            if self._own_observers:
                self._observers.close()  # outside the event loop: the curve is drawn here
            self._bound.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        context = zmq.asyncio.Context()
        try:
            coordinator = Coordinator(
                self.config,
                bind=self._bind,
                context=context,
                run_id=self._run_id,
                fresh=self._fresh,
                security=self._security,
                observers=self._observers,
                **({} if self._log is None else {"log": self._log}),  # type: ignore[arg-type]
            )
            await coordinator.start()
            self._coordinator = coordinator
            self._bound.set()
            try:
                self._outcome = await coordinator.run()
            except RunAborted as exc:
                self._outcome = exc
        finally:
            context.destroy(linger=0)

    # ------------------------------------------------------------------ the caller's side

    def start(self) -> BackgroundCoordinator:
        """Start the thread and return once the socket is bound (raising what stopped it)."""
        self._thread.start()
        self._bound.wait()
        if self._coordinator is None:
            self._thread.join()
            assert isinstance(self._outcome, BaseException)
            raise self._outcome
        return self

    @property
    def endpoint(self) -> str:
        """The address workers connect to (``EPOCHAL_COORDINATOR``); port 0 is resolved."""
        assert self._coordinator is not None and self._coordinator.endpoint is not None
        return self._coordinator.endpoint

    @property
    def run_id(self) -> str:
        """The id of the run this coordinator serves."""
        assert self._coordinator is not None
        return self._coordinator.run_id

    @property
    def running(self) -> bool:
        """Whether the run is still going."""
        return self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> RunSummary:
        """Wait for the run to end; return its summary, or raise RunAborted saying why.

        ``timeout`` (seconds, None: no limit) bounds the wait; past it TimeoutError is raised and
        the run goes on (call :meth:`abort` to stop it).
        """
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the run is still going after {timeout:g} s")
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        assert self._outcome is not None
        return self._outcome

    def abort(self, reason: str) -> None:
        """Abort the run for every worker with ``reason``; returns at once (then :meth:`wait`)."""
        loop, coordinator = self._loop, self._coordinator
        if loop is None or coordinator is None or not self._thread.is_alive():
            return
        try:
            loop.call_soon_threadsafe(coordinator.abort, reason)
        except RuntimeError:  # the loop closed meanwhile: the run is over
            pass

    def close(self, reason: str = "the coordinator was closed before the run ended") -> None:
        """Abort a run still going and wait for the thread. Safe to call twice."""
        if self._thread.is_alive():
            self.abort(reason)
            self._thread.join()

    def __enter__(self) -> BackgroundCoordinator:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if kind is None:
            self.close("the `with start_coordinator(...)` block ended before the run finished")
        else:
            self.close(f"the caller raised {kind.__name__} while the run was going")


def start_coordinator(
    world_size: int,
    *,
    bind: str = "tcp://127.0.0.1:0",
    security: ServerSecurity | None = None,
    fresh: bool = False,
    run_id: str | None = None,
    log: Callable[[str], None] | None = None,
    observers: RunObserver | None = None,
    **options: Any,
) -> BackgroundCoordinator:
    """Start a coordinator for ``world_size`` workers on a thread of this process.

    ``options`` are :class:`~epochal.coordinator.config.CoordinatorConfig` fields (``epochs``,
    ``run_dir``, ``heartbeat_timeout``, ``lr_schedule``, ...). ``bind`` defaults to loopback on a
    free port; ``log`` receives each line the coordinator prints (default: stderr). Use it as a
    context manager: leaving the block aborts a run still going and stops the thread. Without
    ``run_id`` a fresh one is made; without ``run_dir`` nothing is written and nothing can resume.
    ``security`` turns CURVE on: ``ServerSecurity.from_paths("keys/coordinator.key_secret",
    "keys/allowed")``. ``observers`` watch the run (:mod:`epochal.observe`; the caller closes
    them); without, those the options ask for (``tensorboard``, ``metrics_address``, and by
    default RUN_DIR/status.json and curve.png) are made and closed when the run is over.
    """
    known = {f.name for f in fields(CoordinatorConfig)} - {"world_size"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(
            f"start_coordinator() got unknown option(s) {', '.join(unknown)}: use fields of "
            f"CoordinatorConfig ({', '.join(sorted(known))})"
        )
    for name in _PATH_OPTIONS:
        if options.get(name) is not None:
            options[name] = Path(options[name])
    config = CoordinatorConfig(world_size=world_size, **options)
    return BackgroundCoordinator(
        config,
        bind=bind,
        security=security,
        fresh=fresh,
        run_id=run_id,
        log=log,
        observers=observers,
    ).start()
