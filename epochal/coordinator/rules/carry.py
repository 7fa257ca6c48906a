"""Where the journal left a running run, for a restarted coordinator that takes its workers back.

The journal keeps every decision and every go whole (:func:`sent_record`), each fsynced before
any rank heard it; :func:`carry_from` reads back from the records where the run was when its
coordinator stopped (:class:`Carry`), and :func:`replay` rebuilds the loop state the epoch records
decided. No file is read here: :mod:`.resume` reads the run directory and hands the records in.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from epochal.coordinator.config import CoordinatorConfig
from epochal.coordinator.rules.loop import LoopState
from epochal.coordinator.rules.schedule import Schedule
from epochal.errors import MalformedMessage
from epochal.protocol import Decision, Go, Message, decode, encode


@dataclass(frozen=True, slots=True)
class Carry:
    """Where the journal says the run was when its coordinator stopped: epoch ``epoch`` under way
    with ``go`` (sent to some ranks at least), after ``decision`` of the epoch before (None when the
    epoch started from every rank's epoch_ready, so that no rank waits for a decision). A restarted
    coordinator whose workers are still running takes them back there (``Welcome.carry_on``): it
    answers a rank that missed the decision or the go with the journaled one, and no epoch is
    redone (:meth:`~epochal.coordinator.rules.machine.RunMachine` in its taking-back rendezvous)."""

    epoch: int
    go: Go | None
    # None: the decision stopped the run; only the finish is left
    decision: Decision | None
    validates: bool
    # every rank has validation data (the plan of ``epoch``)
    loop: LoopState
    # the loop state after every decided epoch (not only up to the last checkpoint)
    records: list[dict[str, Any]]
    # every standing journal record: the journal is kept whole when the run carries on
    world_size: int
    generation: int
    attempt_id: str
    # the id the running workers know the run by (run.json's; a coordinator that takes them back
    # keeps it: see .attempts)

    @property
    def stopped(self) -> bool:
        """The decision stopped the run: only the finish is left."""
        return self.decision is not None and self.decision.stop

    @property
    def gathering(self) -> bool:
        """The decision asked the ranks to gather the state for newcomers (``gather``): each
        announces the epoch with a ready once it has, and no go was sent."""
        return self.decision is not None and self.decision.gather

    @property
    def pending_checkpoint(self) -> int | None:
        """The checkpoint ``decision`` asked for, when the journal holds no commit of it."""
        decision = self.decision
        if decision is None or not decision.checkpoint:
            return None
        committed = {r["epoch"] for r in self.records if r["kind"] == "checkpoint"}
        return None if decision.epoch in committed else decision.epoch


def sent_record(message: Message) -> str:
    """A message as a journal record keeps it, to be sent again exactly (:func:`sent_message`)."""
    return base64.b64encode(encode(message)).decode("ascii")


def sent_message(text: Any) -> Message | None:
    """The message :func:`sent_record` kept; None when it does not decode (another protocol
    version wrote it, or it is not one)."""
    try:
        return decode(base64.b64decode(str(text), validate=True))
    except (ValueError, MalformedMessage):
        return None


def carry_from(
    config: CoordinatorConfig,
    records: list[dict[str, Any]],
    attempt_id: str | None,
    schedule: Schedule | None = None,
) -> Carry | None:
    """Where a restarted coordinator may take running workers back (see :class:`Carry`): after
    the journal's last decision or go; None when it holds none, or a world was forming. The loop
    is replayed under ``schedule`` (the run's, as resumes kept it), else the config's."""
    last = next((r for r in reversed(records) if r["kind"] in ("epoch", "go", "world")), None)
    if last is None or last["kind"] == "world" or attempt_id is None:
        return None
    sent = last.get("next") if last["kind"] == "epoch" else last
    if not isinstance(sent, dict):
        return None  # written before decisions were journaled whole
    message = sent_message(sent.get("sent"))
    if last["kind"] == "epoch":
        if not isinstance(message, Decision) or message.epoch != last["epoch"]:
            return None
        decision, go, epoch = message, message.go, last["epoch"] + 1
    else:
        if not isinstance(message, Go) or message.epoch != last["epoch"]:
            return None
        decision, go, epoch = None, message, last["epoch"]
    loop = LoopState.from_config(config)
    loop.schedule = schedule or loop.schedule
    replay(loop, records)
    return Carry(
        epoch=epoch,
        go=go,
        decision=decision,
        validates=bool(sent.get("validates")),
        loop=loop,
        records=records,
        world_size=int(last.get("world_size", config.world_size)),
        generation=int(last.get("generation", 0)),
        attempt_id=attempt_id,
    )


def replay(loop: LoopState, records: list[dict[str, Any]]) -> None:
    """Rebuild ``loop`` by the epoch records, as the run decided them."""
    for record in records:
        if record["kind"] == "epoch":
            loop.update(
                record["epoch"],
                record["train_loss"],
                record["valid_loss"],
                validates=bool(record["validates"]),
                metrics={key: float(record[key]) for key in record.get("metrics", ())},
            )
