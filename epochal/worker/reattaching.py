"""A session whose coordinator went silent says hello again: to the same coordinator, which was
only stalled (the exchange goes on where it was), or to a restarted one, which takes it back
where it is from its journal (``welcome.carry_on``: the worker sends again what it awaits an
answer to, and nothing is redone) or, from an older coordinator, resumes the run from its last
committed checkpoint (:class:`TakenBack`).

:class:`Reattaching` is the part of :class:`~epochal.worker.session.Session` that does it; the
session sets every attribute below in its ``__init__``.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from epochal.errors import CoordinatorLost, CoordinatorUnreachable, JoinRefused
from epochal.log import WORKER
from epochal.protocol import Hello, Welcome
from epochal.worker.control.client import ControlClient
from epochal.worker.control.rendezvous import StillRunning, StoreRef, rendezvous


class TakenBack(Exception):
    """A restarted coordinator took this worker back: resume from the checkpoint it names."""


class Reattaching:
    """Re-attaching to a coordinator; see the module docstring."""

    client: ControlClient
    rank: int
    world_size: int
    backend: str
    run_id: str
    generation: int
    _hello: Hello
    _endpoint: str
    _reattach_timeout: float
    _store_timeout: float
    _store: StoreRef

    def _adopt(self, welcome: Welcome) -> None:
        raise NotImplementedError  # the session's

    def _send_again(self) -> list[str]:
        raise NotImplementedError  # the session's

    def _reattach(self, lost: CoordinatorLost, waiting: tuple[type[Any], ...]) -> Any:
        """Say hello again after losing the coordinator; carry on, or resume from a checkpoint.

        The coordinator that answers is either the same one, which was only stalled (its process
        stopped, its machine suspended) and still runs this run with this worker in it, or a
        restarted one. The same one answers with the message this worker was waiting for
        (``waiting``), queued while it was stalled, or with a ``welcome`` carrying this run's id
        and this worker's session: that answer is returned and the exchange goes on where it was
        (a ``welcome`` is skipped by :meth:`_expect`, as any answer to a retried hello). A
        restarted coordinator issues a new session: the worker adopts its ``welcome`` and raises
        :class:`_TakenBack`, so that :meth:`run_epochs` resumes from its last checkpoint.
        """
        if self._reattach_timeout <= 0:
            raise lost
        WORKER.info(
            f"epochal: rank {self.rank}: {lost.reason}; waiting up to {self._reattach_timeout:g} s "
            "for a coordinator to take this worker back"
        )
        session = self.client.session
        hello = replace(self._hello, rank_hint=self.rank, run_id=self.run_id)
        stalled_since = time.monotonic()
        try:
            welcome, _ = rendezvous(
                self.client,
                hello,
                self._endpoint,
                self._reattach_timeout,
                self._store_timeout,
                store=self._store,
                answers=waiting,
            )
        except StillRunning as running:
            return self._carry_on(running.message, stalled_since)
        except (CoordinatorUnreachable, JoinRefused) as exc:
            raise CoordinatorLost(f"{lost.reason}; and then: {exc}") from None
        if welcome.run_id == self.run_id and welcome.session == session:
            return self._carry_on(welcome, stalled_since)
        if welcome.carry_on:
            return self._taken_back(welcome)
        same = (welcome.rank, welcome.world_size, welcome.backend)
        if same != (self.rank, self.world_size, self.backend):
            raise CoordinatorLost(
                f"the restarted coordinator gave rank {welcome.rank} of {welcome.world_size} "
                f"({welcome.backend}) to what was rank {self.rank} of {self.world_size} "
                f"({self.backend}): the running process group cannot change; restart the run"
            )
        if welcome.resume_epoch is None:
            raise CoordinatorLost(
                "the restarted coordinator has no committed checkpoint to resume from, so the "
                "workers cannot carry on: start the run again"
            )
        self._adopt(welcome)
        WORKER.info(
            f"epochal: rank {self.rank}: re-attached to run {self.run_id}; resuming after epoch "
            f"{welcome.resume_epoch}"
        )
        raise TakenBack

    def _taken_back(self, welcome: Welcome) -> Welcome:
        """A restarted coordinator takes this worker back where it is, from its journal: keep the
        process group, adopt the new session and run id, send again what awaits an answer."""
        theirs = (welcome.rank, welcome.world_size, welcome.generation)
        if theirs != (self.rank, self.world_size, self.generation):
            raise CoordinatorLost(
                f"the restarted coordinator took what was rank {self.rank} of {self.world_size} "
                f"(world {self.generation}) back as rank {welcome.rank} of {welcome.world_size} "
                f"(world {welcome.generation}): the running process group cannot change; "
                "restart the run"
            )
        self.run_id = welcome.run_id
        self.client.watch_coordinator()
        sent = self._send_again()
        WORKER.info(
            f"epochal: rank {self.rank}: re-attached to run {self.run_id}: the restarted "
            f"coordinator carries on from its journal where this worker was (epoch "
            f"{self.client.epoch}); sent again: {', '.join(sent) or 'nothing'}"
        )
        return welcome  # skipped by _expect, which waits on for the answer

    def _carry_on(self, answer: Any, stalled_since: float) -> Any:
        """The coordinator that was lost answered again: it was stalled, not gone; go on."""
        self.client.watch_coordinator()
        WORKER.info(
            f"epochal: rank {self.rank}: the coordinator of run {self.run_id} answered again after "
            f"{time.monotonic() - stalled_since:.1f} s (it was stalled, not restarted); carrying "
            f"on where this worker was (epoch {self.client.epoch})"
        )
        return answer
