"""A session whose coordinator went silent says hello again: to the same coordinator, which was
only stalled (the exchange goes on where it was), or to a restarted one, which takes it back
where it is from its journal (``welcome.carry_on``: the worker sends again what it awaits an
answer to, and nothing is redone) or, from an older coordinator, resumes the run from its last
committed checkpoint (:class:`TakenBack`).

:class:`Reattach` says the hello and adopts what the answer changes of the session's
:class:`~epochal.worker.sessionparts.standing.Standing`; what is sent again is the exchange's,
which the session asks when :meth:`Reattach.reattach` returns :class:`KeptWhereItWas`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from epochal.errors import CoordinatorLost, CoordinatorUnreachable, JoinRefused
from epochal.log import WORKER
from epochal.protocol import Hello, Welcome
from epochal.worker.control.admission import StillRunning, rendezvous
from epochal.worker.control.client import ControlClient
from epochal.worker.sessionparts.standing import Standing


class TakenBack(Exception):
    """A restarted coordinator took this worker back: resume from the checkpoint it names."""


@dataclass(frozen=True, slots=True)
class KeptWhereItWas:
    """A restarted coordinator took this worker back where it is, from its journal: the process
    group stays, and what awaits an answer must be sent again (then the wait goes on)."""

    welcome: Welcome


class Reattach:
    """Re-attaching to a coordinator; see the module docstring."""

    def __init__(
        self,
        client: ControlClient,
        standing: Standing,
        *,
        hello: Hello,
        endpoint: str,
        timeout: float,
        store_timeout: float,
    ) -> None:
        self._client = client
        self._standing = standing
        self._hello = hello  # said again, with this rank and run, to whichever coordinator answers
        self._endpoint = endpoint
        self._timeout = timeout  # how long to wait for a coordinator; 0: a lost one ends the run
        self._store_timeout = store_timeout

    def reattach(self, lost: CoordinatorLost, waiting: tuple[type[Any], ...]) -> Any:
        """Say hello again after losing the coordinator; carry on, or resume from a checkpoint.

        The coordinator that answers is either the same one, which was only stalled (its process
        stopped, its machine suspended) and still runs this run with this worker in it, or a
        restarted one. The same one answers with the message this worker was waiting for
        (``waiting``), queued while it was stalled, or with a ``welcome`` carrying this run's id
        and this worker's session: that answer is returned and the exchange goes on where it was
        (a ``welcome`` is skipped, as any answer to a retried hello). A restarted coordinator
        issues a new session: one that carries on from its journal is answered
        :class:`KeptWhereItWas`; from any other the worker adopts its ``welcome`` and raises
        :class:`TakenBack`, so that the epoch loop resumes from its last checkpoint.
        """
        if self._timeout <= 0:
            raise lost
        standing = self._standing
        WORKER.info(
            f"epochal: rank {standing.rank}: {lost.reason}; waiting up to {self._timeout:g} s "
            "for a coordinator to take this worker back"
        )
        session = self._client.session
        hello = replace(self._hello, rank_hint=standing.rank, run_id=standing.run_id)
        stalled_since = time.monotonic()
        try:
            welcome, _ = rendezvous(
                self._client,
                hello,
                self._endpoint,
                self._timeout,
                self._store_timeout,
                store=standing.store,
                answers=waiting,
            )
        except StillRunning as running:
            return self._carry_on(running.message, stalled_since)
        except (CoordinatorUnreachable, JoinRefused) as exc:
            raise CoordinatorLost(f"{lost.reason}; and then: {exc}") from None
        if welcome.run_id == standing.run_id and welcome.session == session:
            return self._carry_on(welcome, stalled_since)
        if welcome.carry_on:
            return self._kept(welcome)
        self._resume(welcome)
        raise TakenBack

    def said_again(self, sent: list[str]) -> None:
        """Log what was sent again to the coordinator that kept this worker where it was."""
        WORKER.info(
            f"epochal: rank {self._standing.rank}: re-attached to run {self._standing.run_id}: "
            f"the restarted coordinator carries on from its journal where this worker was (epoch "
            f"{self._client.epoch}); sent again: {', '.join(sent) or 'nothing'}"
        )

    def _resume(self, welcome: Welcome) -> None:
        """A restarted coordinator resumes the run from its last committed checkpoint, in the
        same process group: adopt its welcome."""
        standing = self._standing
        same = (welcome.rank, welcome.world_size, welcome.backend)
        if same != (standing.rank, standing.world_size, standing.backend):
            raise CoordinatorLost(
                f"the restarted coordinator gave rank {welcome.rank} of {welcome.world_size} "
                f"({welcome.backend}) to what was rank {standing.rank} of {standing.world_size} "
                f"({standing.backend}): the running process group cannot change; restart the run"
            )
        if welcome.resume_epoch is None:
            raise CoordinatorLost(
                "the restarted coordinator has no committed checkpoint to resume from, so the "
                "workers cannot carry on: start the run again"
            )
        standing.adopt(welcome)
        WORKER.info(
            f"epochal: rank {standing.rank}: re-attached to run {standing.run_id}; resuming after "
            f"epoch {welcome.resume_epoch}"
        )

    def _kept(self, welcome: Welcome) -> KeptWhereItWas:
        """A restarted coordinator takes this worker back where it is, from its journal: keep the
        process group, adopt the new session and run id."""
        standing = self._standing
        theirs = (welcome.rank, welcome.world_size, welcome.generation)
        if theirs != (standing.rank, standing.world_size, standing.generation):
            raise CoordinatorLost(
                f"the restarted coordinator took what was rank {standing.rank} of "
                f"{standing.world_size} (world {standing.generation}) back as rank "
                f"{welcome.rank} of {welcome.world_size} (world {welcome.generation}): the "
                "running process group cannot change; restart the run"
            )
        standing.run_id = welcome.run_id
        self._client.watch_coordinator()
        return KeptWhereItWas(welcome)

    def _carry_on(self, answer: Any, stalled_since: float) -> Any:
        """The coordinator that was lost answered again: it was stalled, not gone; go on."""
        self._client.watch_coordinator()
        WORKER.info(
            f"epochal: rank {self._standing.rank}: the coordinator of run {self._standing.run_id} "
            f"answered again after {time.monotonic() - stalled_since:.1f} s (it was stalled, not "
            f"restarted); carrying on where this worker was (epoch {self._client.epoch})"
        )
        return answer
