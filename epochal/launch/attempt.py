"""One attempt of ``epochal run``: a started coordinator's local workers, watched to their end.

:class:`Attempt` starts the workers (forked from the preloaded process where there is one), prefixes
what they print with their rank, replaces a lost worker in an elastic run, passes a signal on to
them, stands the coordinator down for a script with a process group of its own
(:mod:`epochal.launch.plainscript`), waits for them to exit (killing those that outstay their
bound), and says how the attempt ended as an :class:`~epochal.launch.restarts.Outcome`.
:mod:`epochal.launch.launcher` makes one per attempt and restarts the run as that outcome asks.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
from collections.abc import Sequence
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
    VERBOSE_ENV,
    WORKER_ID_ENV,
    WORLD_SIZE_ENV,
)
from epochal.errors import EpochalError, RunAborted
from epochal.launch.plainscript import PLAIN_LINE, free_port, made_its_own_group, wait_plain
from epochal.launch.preload import Forked, Preload, Preloaded, worker_threads
from epochal.launch.processes import Child, die_with_parent, kill_group
from epochal.launch.restarts import Outcome
from epochal.log import LAUNCHER, child_environment
from epochal.output import RankStream, Relay
from epochal.text import counted, exit_words

EXIT_OK = 0
EXIT_FAILED = 1

NEVER_CALLED_HINT = (
    "; did the script call epochal.train() or epochal.join()? (an `if __name__ == "
    "'__main__':` guard around a function that is never called does this too)"
)


def say(line: str, level: int) -> None:
    """One of the launcher's own lines."""
    LAUNCHER.log(level, f"[epochal] {line}")


async def _pump(stream: asyncio.StreamReader, prefixer: RankStream) -> None:
    while chunk := await stream.read(65536):
        prefixer.feed(chunk.decode(errors="replace"))
    prefixer.close()


def worker_environment(
    base: dict[str, str], index: int, nproc: int, worker_id: str, master_port: int
) -> dict[str, str]:
    """The environment of local worker ``index`` of ``nproc``: epochal's variables, and
    torchrun's (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``) so that a script written for torchrun runs unchanged (see
    :mod:`epochal.launch.plainscript`)."""
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


def _workers_environment(
    endpoint: str, config: CoordinatorConfig, nproc: int, out: TextIO, verbose: bool
) -> dict[str, str]:
    """What every local worker's environment holds, before :func:`worker_environment` adds its
    own variables."""
    env = dict(os.environ)
    env[COORDINATOR_ENV] = endpoint
    env[JOB_ENV] = config.job
    env[WORLD_SIZE_ENV] = str(nproc)  # not a Slurm/torchrun world this may run inside
    env[REATTACH_TIMEOUT_ENV] = "0"  # this coordinator dies with the launcher: stop at once
    if config.token:
        env[TOKEN_ENV] = config.token
    env.update(child_environment())  # the workers log as the launcher does
    env.setdefault("PYTHONUNBUFFERED", "1")
    env = worker_threads(env)  # N workers on one machine: don't oversubscribe
    if out.isatty():
        env.setdefault(PROGRESS_ENV, "1")
    if verbose:
        env[VERBOSE_ENV] = "1"  # the workers keep their tracebacks too
    return env


async def _wait_for_exit(
    watchers: list[asyncio.Task[int]],
    bound: float | None,
    interrupted: list[str],
    abort_exit: float,
) -> None:
    """Wait for every worker to exit, at most ``bound`` seconds (None: no bound); a signal
    received meanwhile bounds the wait to ``abort_exit`` (the launcher's ``abort_exit_timeout``)
    from then on."""
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


class Attempt:
    """The local workers of one attempt, from their start to the attempt's outcome
    (:meth:`run`). ``coordinator`` is started, at ``endpoint``; ``abort_exit`` bounds the wait for
    the workers of an aborted or interrupted run, ``exit_timeout`` (None: no bound) that for the
    workers of a finished one. An elastic run replaces lost workers, up to ``max_restarts`` of
    them, instead of restarting."""

    def __init__(
        self,
        coordinator: Coordinator,
        config: CoordinatorConfig,
        nproc: int,
        command: list[str],
        out: TextIO,
        *,
        endpoint: str,
        verbose: bool,
        exit_timeout: float | None,
        abort_exit: float,
        max_restarts: int = 0,
    ) -> None:
        self.coordinator = coordinator
        self.config = config
        self.nproc = nproc
        self.command = command
        self.exit_timeout = exit_timeout
        self.abort_exit = abort_exit
        self.env_base = _workers_environment(endpoint, config, nproc, out, verbose)
        self.master_port = free_port()  # for a script that makes its own process group
        self.relay = Relay(out, verbose=verbose)
        self.width = len(str(nproc - 1))
        self.preloaded: Preloaded | None = None
        self.procs: list[Child] = []
        self.pumps: list[asyncio.Task[None]] = []
        self.slots: list[int] = []
        """The worker index each process stands for (a replacement takes its lost worker's)."""
        self.watchers: list[asyncio.Task[int]] = []
        self.interrupted: list[str] = []
        """The name of the first signal received, once one was."""
        self.spares = max_restarts if config.elastic else 0
        self.replaced: list[int] = []
        self.replacing: list[asyncio.Task[None]] = []
        self.spare_positions: list[int] = []
        """The processes started as replacements."""
        self.lost: list[int] = []
        """Workers whose rank was lost while the others carried on (an elastic run)."""
        self.plain = False
        """Whether the coordinator stood down for a script with a process group of its own."""
        self.failed_first: int | None = None
        """In such a run, the worker that failed first."""
        self.summary: RunSummary | None = None
        self.reason = ""
        self.needs_fix = False
        """The run was aborted by a configuration or data error: no restart mends it."""
        self.stuck: list[int] = []
        """The workers still running when the wait for them ended, killed."""
        self.codes: list[int] = []
        self.bound: float | None = None

    async def run(self, preload: Preload | None) -> Outcome:
        """Start the workers, run the coordinator to its end, wait for the workers; the outcome."""
        if preload is not None:
            self.preloaded = await preload.get(
                self._preload_failed, said=lambda line: say(line, logging.INFO)
            )
        for index in range(self.nproc):
            await self._start(index, f"{self.coordinator.attempt.attempt_id}/local-{index}")
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._on_signal, signum)
        self.watchers = [asyncio.create_task(self._watch(i, p)) for i, p in enumerate(self.procs)]
        detector = asyncio.create_task(self._stand_down())
        try:
            await self._supervise()
        except RunAborted as exc:
            self._aborted(exc)
        finally:
            detector.cancel()
            await self._end()
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)
            self.relay.release(known_reasons=self.reason)
        if self.plain:
            return _plain_outcome(self.codes, self.failed_first, self.interrupted)
        return self._outcome()

    def _preload_failed(self) -> None:
        say(
            "the process that imports torch once for every worker has ended (its error, if it "
            "had one, is above): each worker imports torch itself from now on",
            logging.WARNING,
        )

    async def _start(self, index: int, worker_id: str) -> Child:
        env = worker_environment(self.env_base, index, self.nproc, worker_id, self.master_port)
        proc: asyncio.subprocess.Process | Forked | None = None
        if self.preloaded is not None:
            try:
                proc = await self.preloaded.spawn(self.command, env)
            except EpochalError as exc:  # it ended meanwhile (killed, say)
                say(
                    f"{exc}: worker {index} and those after it import torch themselves",
                    logging.WARNING,
                )
                self.preloaded = None
        if proc is None:
            proc = await asyncio.create_subprocess_exec(
                *self.command,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=functools.partial(die_with_parent, os.getpid()),
            )
        self.procs.append(proc)
        self.slots.append(index)
        assert proc.stdout is not None
        prefixer = self.relay.stream(f"[rank {index:>{self.width}}] ", rank=index)
        self.pumps.append(asyncio.create_task(_pump(proc.stdout, prefixer)))
        return proc

    def _on_signal(self, signum: int) -> None:
        if self.interrupted:  # a second Ctrl-C: stop waiting for anyone
            for p in self.procs:
                kill_group(p.pid, signal.SIGKILL)
            return
        name = signal.Signals(signum).name
        self.interrupted.append(name)
        self.relay.stop()
        self.coordinator.abort(f"the launcher received {name}")
        for p in self.procs:
            kill_group(p.pid, signum)

    async def _watch(self, position: int, proc: Child) -> int:
        code = await proc.wait()
        phase = self.coordinator.phase.value
        index = self.slots[position]
        if self.plain:
            pass  # the launcher alone watches a plain run's workers (wait_plain)
        elif phase not in ("finishing", "ended"):
            what = exit_words(code)
            hint = NEVER_CALLED_HINT if code == 0 and phase == "rendezvous" else ""
            failure = f"worker {index} (pid {proc.pid}) {what} before the run finished{hint}"
            if self.coordinator.worker_exited(proc.pid, what, failure):
                self.lost.append(position)  # the others carry on without it
                if len(self.replaced) < self.spares and not self.interrupted:
                    self.replaced.append(position)
                    replacement = self._replace(index, len(self.replaced), proc.pid)
                    self.replacing.append(asyncio.create_task(replacement))
        elif code != 0 and self.coordinator.was_lost(proc.pid):
            self.lost.append(position)  # dropped from the run (frozen, say), and it ended after it
        return code

    async def _replace(self, index: int, n: int, gone: int) -> None:
        """Start a replacement for lost worker ``index`` (process ``gone``): it joins at the next
        boundary. It is started once the coordinator has taken ``gone``'s rank out of the world
        (its connection closed with it: at once; at most ``heartbeat_timeout`` seconds): a
        replacement forked from the preloaded process says hello within milliseconds, and a
        hello while the world still counts the lost rank is refused as one worker too many."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.heartbeat_timeout
        while self.coordinator.in_world(gone) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        worker_id = f"{self.coordinator.attempt.attempt_id}/local-{index}/{n}"
        proc = await self._start(index, worker_id)
        position = self.procs.index(proc)  # _start() appended it
        self.spare_positions.append(position)
        say(
            f"worker {index} lost: started {worker_id} (pid {proc.pid}) in its place, "
            f"replacement {n} of {self.spares}; it joins at the next epoch boundary",
            logging.INFO,
        )
        self.watchers.append(asyncio.create_task(self._watch(position, proc)))

    async def _stand_down(self) -> None:
        seen = await made_its_own_group(
            self.master_port, self.coordinator.heard_from_no_worker, [p.pid for p in self.procs]
        )
        if seen and self.coordinator.stand_down(PLAIN_LINE):
            self.plain = True

    async def _supervise(self) -> None:
        """Run the coordinator to its end; stop the replacements the run finished without; in a
        plain run, wait for the workers (no bound: the script trains for as long as it does)."""
        self.summary = await self.coordinator.run()
        for position in self.spare_positions:
            proc = self.procs[position]
            if proc.returncode is None and not self.coordinator.in_world(proc.pid):
                # a replacement the run finished without (starting, or waiting for a boundary)
                self.lost.append(position)
                kill_group(proc.pid, signal.SIGTERM)
                say(
                    f"worker {self.slots[position]}'s replacement (pid {proc.pid}) had not "
                    "joined when the run finished; stopped",
                    logging.INFO,
                )
        if self.plain:
            self.failed_first = await wait_plain(self.procs, self.watchers, self.abort_exit)

    def _aborted(self, exc: RunAborted) -> None:
        self.reason, self.needs_fix = exc.reason, exc.needs_fix
        self.relay.stop()
        # still connecting when the rendezvous was aborted (another worker's model or --monitor,
        # say): nothing tells them, and they have nothing to keep
        running = [p.pid for p in self.procs if p.returncode is None]
        for pid in self.coordinator.never_joined(running):
            kill_group(pid, signal.SIGTERM)

    async def _end(self) -> None:
        """Wait for the workers within their bound, kill those still running, and their
        children; the exit statuses."""
        await asyncio.gather(*self.replacing, return_exceptions=True)
        self.bound = self.exit_timeout if self.summary is not None else self.abort_exit
        await _wait_for_exit(self.watchers, self.bound, self.interrupted, self.abort_exit)
        self.stuck = [i for i, p in enumerate(self.procs) if p.returncode is None]
        for i in self.stuck:
            kill_group(self.procs[i].pid, signal.SIGKILL)
        self.codes = [await w for w in self.watchers]
        for p in self.procs:  # the workers' children (data loader workers) go too
            kill_group(p.pid, signal.SIGKILL)
        await asyncio.gather(*self.pumps, return_exceptions=True)

    def _outcome(self) -> Outcome:
        """How the attempt ended, said in the launcher's last line."""
        summary, interrupted, slots = self.summary, self.interrupted, self.slots
        hidden = hidden_note(self.relay.hidden, self.relay.hidden_causes)
        bound = self.bound
        if interrupted and summary is not None:
            bound = self.abort_exit  # the signal bounded a wait that had none
        stuck = _workers([slots[i] for i in self.stuck]) if self.stuck else ""
        killed = f"; {stuck} still running {bound:g} s later and killed" if stuck else ""
        if interrupted:
            when = " after the run finished (result.json says so)" if summary is not None else ""
            say(f"interrupted by {interrupted[0]}{when}{killed}{hidden}", logging.WARNING)
            status = 128 + int(getattr(signal, interrupted[0]))
            return Outcome(status, self.reason, unfinished=summary is None)
        if summary is None:
            say(f"FAILED: the run was aborted (the reason is above){killed}{hidden}", logging.ERROR)
            if self.needs_fix:  # a restart would stop on the same error
                return Outcome(EXIT_FAILED, self.reason, unfinished=True, needs_fix=True)
            return Outcome(EXIT_FAILED, self.reason, retry=True, unfinished=True)
        if stuck:
            say(
                f"FAILED: the run finished (result.json says so), but {stuck} still "
                f"running {bound:g} s later (--exit-timeout) and killed",
                logging.ERROR,
            )
            return Outcome(EXIT_FAILED, "workers did not exit after the finish")
        bad = [(i, c) for i, c in enumerate(self.codes) if c != 0 and i not in self.lost]
        if bad:
            listed = ", ".join(f"worker {slots[i]}: status {c}" for i, c in bad)
            say(
                "FAILED: the run finished (result.json says so), but the script failed after "
                f"epochal.train() returned ({listed})",
                logging.ERROR,
            )
            return Outcome(EXIT_FAILED, f"workers exited non-zero ({listed})")
        if summary.epochs_run == 0:  # join() for the process group only: the script's own loop
            say(
                f"done: {counted(len(self.codes), 'worker')} closed their sessions and exited 0",
                logging.INFO,
            )
            return Outcome(EXIT_OK)
        without = _lost_note(self.lost, self.spare_positions, slots)
        say(f"done: best epoch {summary.best_epoch} of {summary.epochs_run}{without}", logging.INFO)
        return Outcome(EXIT_OK)


def _lost_note(lost: list[int], spare_positions: list[int], slots: list[int]) -> str:
    """What a finished run's last line adds about the workers it lost on the way (positions
    ``lost``) and those replaced (``spare_positions``); ``slots`` maps positions to workers."""
    if not lost:
        return ""
    gone = sorted({slots[i] for i in lost if i not in spare_positions})
    back = sorted({slots[i] for i in spare_positions if i not in lost})
    listed = ", ".join(map(str, gone))
    what = "lost on the way"
    if back == gone:
        what = "lost and replaced"
    elif back:
        what += f"; worker{'s' if len(back) > 1 else ''} {', '.join(map(str, back))} replaced"
    return f" (worker{'s' if len(gone) > 1 else ''} {listed} {what})"


def _plain_outcome(codes: list[int], first: int | None, interrupted: list[str]) -> Outcome:
    """How a plain run (a torchrun script, :mod:`epochal.launch.plainscript`) ended: finished when
    every worker exited 0; else ``first`` failed first."""
    if interrupted:
        say(f"interrupted by {interrupted[0]}", logging.WARNING)
        return Outcome(128 + int(getattr(signal, interrupted[0])), "interrupted")
    if first is None:
        say(f"done: {counted(len(codes), 'worker')} exited 0", logging.INFO)
        return Outcome(EXIT_OK)
    reason = f"worker {first} {exit_words(codes[first])}; the others were stopped"
    say(f"FAILED: {reason}", logging.ERROR)
    return Outcome(EXIT_FAILED, reason, retry=True)


def hidden_note(hidden: int, causes: Sequence[str] = ()) -> str:
    """What the launcher's last line adds about the ``hidden`` lines of worker output; ``causes``:
    the errors among them that the abort's reason says are in a worker's output."""
    if hidden == 0:
        return ""
    if causes:
        named = " and ".join(causes)
        if hidden == 1:
            return (
                f"; 1 line of worker output is hidden, the {named} the reason points to "
                "(--verbose shows it)"
            )
        return (
            f"; {hidden} lines of worker output are hidden, the {named} the reason points to "
            "among them (--verbose shows them)"
        )
    if hidden == 1:
        return "; 1 line of worker output that follows from it is hidden (--verbose shows it)"
    return (
        f"; {hidden} lines of worker output that follow from it are hidden (--verbose shows them)"
    )


def _workers(indices: list[int]) -> str:
    if len(indices) == 1:
        return f"worker {indices[0]} was"
    return f"workers {', '.join(map(str, indices))} were"
