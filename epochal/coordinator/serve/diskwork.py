"""The coordinator's slow file work, done off its event loop: deleting the checkpoints a commit
pruned, and telling the observers (status.json, TensorBoard, Prometheus).

Under ``epochal run`` a coordinator silent for the heartbeat timeout stops every worker, and an
``rmtree`` of a checkpoint on a slow shared filesystem, or a status.json written to one, can take
that long. So the service hands that work to a :class:`DiskWork`: a thread that runs its jobs one
at a time, in the order they were given, so a status.json write is never overtaken by an older
one and the observers hear the end last. A job may supersede the one queued just before it (a
heartbeat's snapshot, the one before it still unwritten): a slow disk is written the newest
snapshot, not a backlog that grows as long as the disk stays slow (a join's likewise: the
observers keep only the newest world). The thread exists while there is work and ends once there
was none for :data:`IDLE_SECONDS`: a rendezvous of thousands gives it a job a join, and a thread
started for each cost the loop more than the job.

A job that fails is recorded with what it was doing, and the service logs it at one point of its
loop (:meth:`DiskWork.take_failures`), once: the same failure again is counted, and the count
said when the run ends. The run's end waits for the jobs given before it (:meth:`DiskWork.drain`,
bounded by :data:`DRAIN_TIMEOUT`) before the run is reported done; what is still going then is
said. :class:`OffLoop` is an observer that hands every call to a DiskWork. The journal is not
here: a decision's record is on disk before the decision is sent, on purpose.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epochal.observe import RunObserver, RunStart, StatusSnapshot, World

DRAIN_TIMEOUT = 60.0
"""Seconds the end of a run waits for the disk work given before it (a checkpoint being deleted,
the last status.json); past it the run is reported done and what is left is said."""

STATUS = "status"
"""The kind of an observer's heartbeat snapshot: a newer one supersedes one still queued."""

JOIN = "join"
"""The kind of a worker's join: the newer world supersedes one still queued."""

IDLE_SECONDS = 2.0
"""How long the thread waits for another job before it ends."""


@dataclass(slots=True)
class _Job:
    what: str
    # what it does, as a failure says it: "deleting the checkpoint of epoch 3 (/ckpt/epoch_3)"
    run: Callable[[], None]
    kind: str | None
    # jobs of one kind supersede the queued one before them (None: never)


class DiskWork:
    """Jobs run in order on a thread of their own; see the module docstring."""

    def __init__(self, name: str) -> None:
        self.name = name
        # the thread's name
        self._jobs: deque[_Job] = deque()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        # told of each job given while the thread waits for one
        self._thread: threading.Thread | None = None
        self._running: str | None = None
        # what the thread is doing now
        self._failed: dict[str, int] = {}
        # what failed, and how many times
        self._unsaid: list[str] = []
        # failures not yet handed to the service to log

    def submit(self, what: str, run: Callable[[], None], *, kind: str | None = None) -> None:
        """Run ``run`` after every job given before it; ``what`` names it in a failure."""
        job = _Job(what, run, kind)
        with self._lock:
            if kind is not None and self._jobs and self._jobs[-1].kind == kind:
                self._jobs[-1] = job
            else:
                self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self._thread.start()
            else:
                self._work.notify()

    def _serve(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    self._work.wait(IDLE_SECONDS)
                if not self._jobs:
                    self._thread = None
                    return
                job = self._jobs.popleft()
                self._running = job.what
            try:
                job.run()
            except Exception as exc:  # recorded, and logged by the service: never the run's
                self._record(job.what, exc)
            finally:
                with self._lock:
                    self._running = None

    def _record(self, what: str, exc: Exception) -> None:
        with self._lock:
            seen = self._failed.get(what, 0)
            self._failed[what] = seen + 1
            if not seen:
                self._unsaid.append(f"{what} failed: {type(exc).__name__}: {exc}")

    def take_failures(self) -> list[str]:
        """The failures not said yet, one line each (a failure seen before is only counted)."""
        with self._lock:
            lines, self._unsaid = self._unsaid, []
        return lines

    def repeats(self) -> list[str]:
        """One line per failure that happened more than once, with its count."""
        with self._lock:
            return [f"{what} failed {n} times" for what, n in self._failed.items() if n > 1]

    def pending(self) -> list[str]:
        """What is running or queued, in order."""
        with self._lock:
            running = [] if self._running is None else [self._running]
            return running + [job.what for job in self._jobs]

    async def drain(self, timeout: float) -> list[str]:
        """Wait, without holding up the event loop, until every job given so far has run, at
        most ``timeout`` seconds; return what is still running or queued then (nothing: all
        done). Jobs still queued then are dropped, the running one is left to end."""
        with self._lock:
            if self._thread is None:
                return []  # nothing given, or all of it done
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def finished() -> None:
            if not done.done():
                done.set_result(None)

        def barrier() -> None:  # runs after every job given before it
            try:
                loop.call_soon_threadsafe(finished)
            except RuntimeError:  # the loop closed meanwhile: nobody waits
                pass

        self.submit("the end of the disk work", barrier)
        try:
            await asyncio.wait_for(asyncio.shield(done), timeout)
        except TimeoutError:
            pass
        if done.done():
            return []
        with self._lock:
            dropped = [job.what for job in self._jobs if job.run is not barrier]
            self._jobs.clear()
            running = [] if self._running is None else [self._running]
        return running + dropped


def delete_tree(path: Path) -> None:
    """Delete the directory ``path`` and everything in it, as much of it as can be (links are
    removed, never followed); raise OSError naming what could not be and why. A path that is
    not there (a checkpoint directory on the workers' machines, not seen from here) is not an
    error."""
    errors: list[BaseException] = []
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=lambda function, name, exc: errors.append(exc))
    else:
        shutil.rmtree(path, onerror=lambda function, name, info: errors.append(info[1]))
    errors = [e for e in errors if not isinstance(e, FileNotFoundError)]
    if errors:
        first = errors[0]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise OSError(f"{type(first).__name__}: {first}{more}; delete it by hand")


class OffLoop(RunObserver):
    """An observer that hands every call to ``observers`` to ``work``, in the order made; a
    heartbeat's snapshot supersedes the one before it still queued. Its owner closes
    ``observers`` (not through this), once the work is drained."""

    def __init__(self, observers: RunObserver, work: DiskWork) -> None:
        self.observers = observers
        self._work = work

    def __bool__(self) -> bool:
        return bool(self.observers)

    def _later(self, method: str, *args: Any, kind: str | None = None) -> None:
        if not self.observers:
            return  # none to tell: no thread
        call = getattr(self.observers, method)
        self._work.submit(f"telling the observers ({method})", lambda: call(*args), kind=kind)

    def on_start(self, start: RunStart) -> None:
        self._later("on_start", start)

    def on_join(self, world: World) -> None:
        self._later("on_join", world, kind=JOIN)

    def on_epoch(self, record: Mapping[str, Any], status: StatusSnapshot) -> None:
        self._later("on_epoch", dict(record), status)

    def on_status(self, snapshot: StatusSnapshot) -> None:
        self._later("on_status", snapshot, kind=STATUS)

    def on_end(self, result: Mapping[str, Any]) -> None:
        self._later("on_end", dict(result))
