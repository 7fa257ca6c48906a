"""The protocol's closed sets of strings and its rules for names.

A closed set (:class:`Phase`, :class:`Awaiting`, :class:`RejectCode`, :class:`Backend`,
:class:`Device`) travels as a plain ``str``; the codec refuses any other value, so a misspelt one
fails where it is made. The rules for names a user picks (a job's, a metric's) are checked here
for the sender and the codec alike, and :func:`clip` cuts free text to what a field may carry.

This module's imports are private (underscored): ``from epochal.protocol.strings import *``
exports exactly the protocol's names.
"""

import collections.abc as _abc
import enum as _enum
import re as _re
import typing as _typing

from epochal.protocol import limits as _limits

RESERVED_METRIC_NAMES = frozenset({"loss", "batches"})
"""Names a metric may not take: the journal already has ``train_loss``, ``valid_batches``..."""

_METRIC_NAME = _re.compile(rf"^[A-Za-z][A-Za-z0-9_]{{0,{_limits.MAX_METRIC_NAME_CHARS - 1}}}$")


def check_metric_name(name: str) -> str:
    """Return ``name`` if it may name a metric, else raise ValueError saying what is allowed.

    A metric name is 1-64 letters, digits or ``_``, starting with a letter, and not ``loss``
    or ``batches`` (the loss is reported on its own): it becomes part of journal keys
    (``valid_accuracy``) and of ``--monitor``.
    """
    if not isinstance(name, str) or not _METRIC_NAME.fullmatch(name):
        raise ValueError(
            f"metric name {name!r} is not allowed: use 1-{_limits.MAX_METRIC_NAME_CHARS} "
            "letters, digits or '_', starting with a letter"
        )
    if name in RESERVED_METRIC_NAMES:
        raise ValueError(f"{name!r} is reported on its own and cannot name a metric")
    return name


DEFAULT_JOB = "epochal"
"""Job name of a coordinator or worker that was given none."""

_JOB_NAME = _re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_job_name(job: str) -> str:
    """Return ``job`` if it is a valid job name, else raise ValueError saying what is allowed."""
    if not _JOB_NAME.fullmatch(job):
        raise ValueError(
            f"job name {job!r} is not allowed: use 1-128 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    return job


def clip(text: str, limit: int = _limits.MAX_TEXT_CHARS) -> str:
    """Cut ``text`` to what a string field may hold, marking the cut."""
    return text if len(text) <= limit else text[: limit - 15] + " ...[truncated]"


# ------------------------------------------------------------------------ closed sets of strings


class Phase(_enum.StrEnum):
    """Where a worker's training code is; sent with every heartbeat
    (:class:`~epochal.protocol.messages.Status`).

    A ``str`` on the wire; the codec refuses any other value, so a misspelt phase fails where it is
    made, not as a silence the coordinator later blames on the worker.
    """

    RENDEZVOUS = "rendezvous"
    # saying hello and waiting for the other workers
    CONNECT = "connect"
    # opening or joining the data-plane store and initialising the process group
    SETUP = "setup"
    # in the process group, preparing to train (wrapping the model, loading a checkpoint)
    WAITING = "waiting"
    # waiting for the coordinator's answer (Go, Decision, Finish)
    TRAIN = "train"
    VALIDATE = "validate"
    CHECKPOINT = "checkpoint"
    FINISHING = "finishing"

    @property
    def description(self) -> str:
        """The phase in words, for messages: "connecting the data plane"."""
        return _PHASE_WORDS[self]


_PHASE_WORDS = {
    Phase.RENDEZVOUS: "joining the run",
    Phase.CONNECT: "connecting the data plane",
    Phase.SETUP: "setting up before the first epoch",
    Phase.WAITING: "waiting for the coordinator",
    Phase.TRAIN: "training",
    Phase.VALIDATE: "validating",
    Phase.CHECKPOINT: "writing a checkpoint",
    Phase.FINISHING: "finishing",
}

PHASES = tuple(p.value for p in Phase)


class Awaiting(_enum.StrEnum):
    """Which answer a worker in :attr:`Phase.WAITING` waits for
    (:class:`~epochal.protocol.messages.Status`).

    The coordinator counts a wait as a lost message only when it waits for the answer to the
    message the run's phase collects: a rank still waiting for its Go while the others train is
    only slow to hear it (a wide broadcast takes time), not missing its loss report.
    """

    GO = "go"
    # sent epoch_ready (the first epoch of a run or of a resume); waits for Go (or Finish)
    DECISION = "decision"
    # sent epoch_report; waits for the Decision (which carries the next epoch's Go)


class RejectCode(_enum.StrEnum):
    """Why a :class:`~epochal.protocol.messages.Reject` was sent."""

    REFUSED = "refused"
    # the hello was judged and refused
    NOT_MEMBER = "not_member"
    # a message other than hello from a peer the coordinator does not know (e.g. after a restart)
    MALFORMED = "malformed"
    # the frame could not be read
    VERSION = "version"
    # the frame is of another major protocol version


class Restore(_enum.StrEnum):
    """Where the members of a world take the state of the epoch they start from
    (:class:`~epochal.protocol.messages.Welcome`)."""

    NONE = "none"
    # the first world of a run: the checkpoint of resume_epoch, if any, as before
    MEMORY = "memory"
    # each survivor from its in-memory copy of the epoch's start (nothing read from disk)
    CHECKPOINT = "checkpoint"
    # every member from the checkpoint of resume_epoch, resharded to the new size
    PEERS = "peers"
    # newcomers joined: each member keeps (or restores from memory) its state, then every rank
    # takes rank 0's over the data plane


class SnapshotScope(_enum.StrEnum):
    """What one rank's in-memory copy of the start of an epoch holds, as its mode and training
    code say (:class:`~epochal.protocol.messages.EpochReady`): the coordinator decides from it how
    a world that lost ranks, or grows, restores (:class:`Restore`)."""

    WHOLE = "whole"
    # every rank holds the whole model and optimizer (replicated): any survivor's copy serves
    ROOT = "root"
    # every rank holds the model, rank 0 alone the optimizer (main): memory serves while rank 0
    # lives
    SHARD = "shard"
    # each rank holds its shard (sharded, fully_sharded): a lost rank takes its shard with it, so
    # the world restores the last checkpoint, which DCP reshards to the new size
    OFF = "off"
    # the training code keeps no copy (switched off): the world restores the last checkpoint

    def restore_after(self, lost: _abc.Collection[int]) -> Restore:
        """How a world whose ranks hold copies of this scope restores after losing the ranks
        ``lost`` of the old world, or, with none lost, as newcomers join it: from the copies
        (memory; a newcomer from its peers) where they hold the whole state, else from the last
        committed checkpoint."""
        if self is SnapshotScope.WHOLE or (self is SnapshotScope.ROOT and 0 not in lost):
            return Restore.MEMORY if lost else Restore.PEERS
        return Restore.CHECKPOINT

    @classmethod
    def least(cls, scopes: "_abc.Iterable[SnapshotScope | str]") -> "SnapshotScope":
        """The scope a world's copies have together: the least any rank's holds (WHOLE when
        none is known)."""
        order = [cls.WHOLE, cls.ROOT, cls.SHARD, cls.OFF]
        return max((cls(s) for s in scopes), key=order.index, default=cls.WHOLE)


class Backend(_enum.StrEnum):
    """The torch.distributed backend every rank initialises
    (:class:`~epochal.protocol.messages.Welcome`)."""

    GLOO = "gloo"
    NCCL = "nccl"


class Device(_enum.StrEnum):
    """The kind of device a worker trains on (:class:`~epochal.protocol.messages.Hello`)."""

    CPU = "cpu"
    CUDA = "cuda"


def one_of(choices: type[_enum.StrEnum], name: str, value: object) -> _enum.StrEnum:
    """``value`` as a member of ``choices``, or ValueError naming field ``name`` and the values
    there are."""
    if isinstance(value, choices):
        return value
    if isinstance(value, str):
        member = choices._value2member_map_.get(value)
        if member is not None:
            return _typing.cast(_enum.StrEnum, member)
    allowed = ", ".join(member.value for member in choices)
    raise ValueError(f"{name} must be one of {allowed}; got {value!r}")


def check_phase(phase: object) -> Phase:
    """``phase`` as a :class:`Phase`, or ValueError naming the phases there are."""
    return _typing.cast(Phase, one_of(Phase, "phase", phase))
