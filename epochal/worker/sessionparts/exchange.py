"""A session's side of its exchange with the coordinator: what this rank awaits an answer to,
what it has said that a restarted coordinator must hear again, and which message received is
the answer awaited.

:class:`Exchange` sends the epoch's ready and report and rank 0's checkpoint commits, and sorts
what comes back (:meth:`Exchange.sort`): the answer, something to skip (a decision sent again, a
world already taken, an answer to a retried hello) or a new world (:class:`RegroupNow`). Receiving
is the session's, which re-attaches when the coordinator is lost in between.

Everything runs on the session's thread but :meth:`Exchange.committed`, which the thread that
writes a checkpoint in the background calls too; a lock makes its send and its note one step
against :meth:`Exchange.say_again`, so a restarted coordinator hears every commit at least once.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from epochal.errors import EpochalError, RunAborted
from epochal.protocol import (
    Checkpointed,
    Decision,
    EpochReady,
    EpochReport,
    Joined,
    Regroup,
    Welcome,
)
from epochal.worker.control.client import ControlClient, RegroupNow
from epochal.worker.control.exits import is_verbose, lost_peer, one_line
from epochal.worker.sessionparts.standing import Standing


class Exchange:
    """This rank's epoch exchange with the coordinator; see the module docstring."""

    def __init__(self, client: ControlClient, standing: Standing) -> None:
        self._client = client
        self._standing = standing
        self._asked: EpochReady | EpochReport | None = None
        # the epoch_ready or epoch_report whose answer this rank awaits (sent again to a restarted
        # coordinator that takes it back where it is)
        self._committed: int | None = None
        # the epoch of the last checkpoint this rank committed (rank 0; sent again likewise)
        self._commits = threading.Lock()
        # held while a commit is sent and noted, and while say_again reads and sends the note
        self._decided: int | None = None
        # the last epoch whose decision this rank has (one sent again is skipped)

    def ask(self, message: EpochReady | EpochReport) -> None:
        """Send ``message``, whose answer this rank now awaits."""
        self._asked = message
        self._client.send(message)

    def answered(self) -> None:
        """The go this rank awaited came: nothing awaits an answer."""
        self._asked = None

    def decided(self, decision: Decision) -> None:
        """``decision`` answered this rank's report; one sent again is skipped from now on."""
        self._decided = decision.epoch
        if not decision.stop:  # after a stop it waits for the finish: the report says where
            self._asked = None

    def committed(self, epoch: int) -> None:
        """Rank 0 committed ``epoch``'s checkpoint (its rename is durable): say so. Safe from a
        second thread (a background write's): the client's send is, and the lock keeps the send
        and the note together against :meth:`say_again`."""
        with self._commits:
            self._client.send(Checkpointed(epoch=epoch))
            self._committed = epoch

    def say_again(self) -> list[str]:
        """A restarted coordinator took this rank back where it is: send again what it awaits
        an answer to, and (rank 0) its last checkpoint's commit; what was sent, for the log."""
        sent = []
        with self._commits:
            committed = self._committed
            if committed is not None:
                self._client.send(Checkpointed(epoch=committed))
                sent.append(f"the commit of the checkpoint of epoch {committed}")
        asked = self._asked
        if asked is not None:
            self._client.send(asked)
            what = "report" if isinstance(asked, EpochReport) else "ready"
            sent.append(f"its {what} of epoch {asked.epoch}")
        return sent

    def sort(self, message: Any, kinds: tuple[type[Any], ...]) -> Any | None:
        """``message`` if it is one of ``kinds``, the answer awaited; None if it is to be skipped.
        RegroupNow for a new world; EpochalError for anything else (out of step)."""
        decided = self._decided
        if (
            isinstance(message, Decision)
            and Decision not in kinds
            and decided is not None
            and message.epoch <= decided
        ):
            return None  # sent again by a restarted coordinator that took this rank back
        if isinstance(message, kinds):
            return message
        if isinstance(message, Regroup):
            if message.generation > self._standing.generation:
                raise RegroupNow(message)
            return None  # taken already (between two batches)
        if isinstance(message, Welcome | Joined):
            return None  # an answer to a retried hello
        expected = " or ".join(k.__name__ for k in kinds)
        raise EpochalError(
            f"expected {expected} from the coordinator, got {type(message).__name__}: "
            "the worker and the coordinator are out of step (mixed epochal versions?)"
        )

    def word_on(self, failure: BaseException) -> RunAborted | None:
        """The coordinator's word on ``failure``, this rank's error just reported, when that is
        the data plane losing a peer: a consequence, whose cause is another rank's failure (the
        coordinator's abort names it) or the coordinator's own silence (every rank's heartbeats
        notice it at once; the first to leave breaks its peers' collectives). Waits up to the
        abort grace for the abort or the silence, to say it instead of the consequence; None for
        any other error, or when no word came in time."""
        if not lost_peer(failure):
            return None
        deadline = time.monotonic() + self._client.abort_grace
        while (left := deadline - time.monotonic()) > 0:
            try:
                self._client.receive(timeout=left)  # anything else is of the epoch that broke
            except RunAborted as word:  # CoordinatorLost too: the silence
                said = one_line(failure, abort_reason=None, verbose=is_verbose())
                if said is not None:  # the error the abort's reason may point to, in one line
                    print(said, file=sys.stderr, flush=True)
                return word
            except TimeoutError:
                return None
        return None
