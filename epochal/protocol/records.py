"""What every control-plane message is made of: limits, closed sets of strings, constraints
declared on field types, the :class:`Record` base and the registry :func:`message` fills.

:mod:`epochal.protocol.messages` defines the messages with these parts; the codec compiles each
message's :class:`FieldSpec` list into its decoder. This module's imports are private
(underscored): ``from epochal.protocol.records import *`` exports exactly the protocol's names.
"""

import dataclasses as _dataclasses
import enum as _enum
import math as _math
import re as _re
import types as _types
import typing as _typing
from collections.abc import Callable as _Callable
from typing import Annotated as _Annotated
from typing import Any as _Any

PROTOCOL_VERSION = 5
"""Bumped on any change to a message's fields or meaning; peers of other versions are refused."""

MAX_FRAME_BYTES = 64 * 1024
"""Largest frame either side accepts, also set as ``ZMQ_MAXMSGSIZE`` on both sockets: libzmq drops
the connection of a peer that announces a larger one before it holds any of it. Every legitimate
message fits, its strings at their longest in four-byte characters (``tests/protocol`` checks the
largest of each type), because every string field is bounded below and a model's parameter list
travels in pages (:class:`ModelPage`)."""

MAX_TEXT_CHARS = 8 * 1024
"""Longest free text (a failure's, an abort's or a refusal's reason); :func:`clip` cuts longer
reasons to it. In four-byte characters it fills half a frame."""

MAX_NAME_CHARS = 1024
"""Longest name-like string: job, token, worker id, host, address, run id, digest, version, a
parameter's name or dtype, a heartbeat's code location. Real ones are a few dozen characters."""

MAX_PATH_CHARS = 4096
"""Longest path a message carries (the checkpoint directory): Linux's PATH_MAX."""

MAX_PARAMS = 100_000
"""Most entries (parameters and buffers) a model's fingerprint may count: the coordinator reads at
most this many from one worker when it fetches a parameter list."""

MAX_PAGE_PARAMS = 4096
"""Most entries one :class:`ModelPage` may hold (a page is also bounded by the frame size: the
shortest entry takes about 20 bytes)."""

MAX_SESSION_CHARS = 64
"""Longest session secret a Joined or Welcome may carry (the coordinator issues 43 characters)."""

MAX_SHAPE_DIMS = 64
"""Most dimensions one parameter's shape may have."""

MAX_METRICS = 64
"""Most named metrics one split of an epoch may report (besides the loss)."""

MAX_METRIC_NAME_CHARS = 64
"""Longest metric name."""

RESERVED_METRIC_NAMES = frozenset({"loss", "batches"})
"""Names a metric may not take: the journal already has ``train_loss``, ``valid_batches``..."""

_METRIC_NAME = _re.compile(rf"^[A-Za-z][A-Za-z0-9_]{{0,{MAX_METRIC_NAME_CHARS - 1}}}$")


def check_metric_name(name: str) -> str:
    """Return ``name`` if it may name a metric, else raise ValueError saying what is allowed.

    A metric name is 1-64 letters, digits or ``_``, starting with a letter, and not ``loss``
    or ``batches`` (the loss is reported on its own): it becomes part of journal keys
    (``valid_accuracy``) and of ``--monitor``.
    """
    if not isinstance(name, str) or not _METRIC_NAME.fullmatch(name):
        raise ValueError(
            f"metric name {name!r} is not allowed: use 1-{MAX_METRIC_NAME_CHARS} letters, digits "
            "or '_', starting with a letter"
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


def clip(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    """Cut ``text`` to what a string field may hold, marking the cut."""
    return text if len(text) <= limit else text[: limit - 15] + " ...[truncated]"


# ------------------------------------------------------------------------ closed sets of strings


class Phase(_enum.StrEnum):
    """Where a worker's training code is; sent with every heartbeat (:class:`Status`).

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
    """Which answer a worker in :attr:`Phase.WAITING` waits for (:class:`Status`).

    The coordinator counts a wait as a lost message only when it waits for the answer to the
    message the run's phase collects: a rank still waiting for its Go while the others train is
    only slow to hear it (a wide broadcast takes time), not missing its loss report.
    """

    GO = "go"
    # sent epoch_ready (the first epoch of a run or of a resume); waits for Go (or Finish)
    DECISION = "decision"
    # sent epoch_report; waits for the Decision (which carries the next epoch's Go)


class RejectCode(_enum.StrEnum):
    """Why a :class:`Reject` was sent."""

    REFUSED = "refused"
    # the hello was judged and refused
    NOT_MEMBER = "not_member"
    # a message other than hello from a peer the coordinator does not know (e.g. after a restart)
    MALFORMED = "malformed"
    # the frame could not be read
    VERSION = "version"
    # the frame is of another protocol version


class Backend(_enum.StrEnum):
    """The torch.distributed backend every rank initialises (:class:`Welcome`)."""

    GLOO = "gloo"
    NCCL = "nccl"


class Device(_enum.StrEnum):
    """The kind of device a worker trains on (:class:`Hello`)."""

    CPU = "cpu"
    CUDA = "cuda"


def _one_of(choices: type[_enum.StrEnum], name: str, value: object) -> _enum.StrEnum:
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
    return _typing.cast(Phase, _one_of(Phase, "phase", phase))


# ------------------------------------------------------------------------ constraints on types


@_dataclasses.dataclass(frozen=True, slots=True)
class Ge:
    """The value is at least ``least``."""

    least: int

    def __call__(self, name: str, value: _Any) -> _Any:
        if not value >= self.least:
            raise ValueError(f"{name} must be >= {self.least}, got {value}")
        return value


@_dataclasses.dataclass(frozen=True, slots=True)
class Within:
    """The value lies in ``lowest..highest``."""

    lowest: int
    highest: int

    def __call__(self, name: str, value: _Any) -> _Any:
        if not self.lowest <= value <= self.highest:
            raise ValueError(f"{name} must be in {self.lowest}..{self.highest}, got {value}")
        return value


@_dataclasses.dataclass(frozen=True, slots=True)
class Finite:
    """The float is neither infinite nor NaN."""

    def __call__(self, name: str, value: _Any) -> _Any:
        if not _math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value}")
        return value


@_dataclasses.dataclass(frozen=True, slots=True)
class Chars:
    """The string is at most ``most`` characters, and not empty unless ``empty``."""

    empty: bool = False
    most: int = MAX_TEXT_CHARS

    def __call__(self, name: str, value: _Any) -> _Any:
        if len(value) > self.most:
            raise ValueError(f"{name} is longer than {self.most} characters")
        if not self.empty and value == "":
            raise ValueError(f"{name} must not be empty")
        return value


@_dataclasses.dataclass(frozen=True, slots=True)
class Length:
    """The string has ``least``..``most`` characters (sessions)."""

    least: int
    most: int

    def __call__(self, name: str, value: _Any) -> _Any:
        if not self.least <= len(value) <= self.most:
            raise ValueError(
                f"{name} must be {self.least}-{self.most} characters, got {len(value)}"
            )
        return value


@_dataclasses.dataclass(frozen=True, slots=True)
class OneOf:
    """The string is a value of ``choices``; the field then holds the enum member."""

    choices: type[_enum.StrEnum]

    def __call__(self, name: str, value: _Any) -> _Any:
        return _one_of(self.choices, name, value)


NonNeg = _Annotated[int, Ge(0)]
"""An int >= 0 (epochs, counts, pids)."""
Positive = _Annotated[int, Ge(1)]
"""An int >= 1 (world sizes, epoch counts)."""
Port = _Annotated[int, Within(1, 65535)]
"""A TCP port number."""
Text = _Annotated[str, Chars()]
"""A non-empty string of at most MAX_TEXT_CHARS characters (free text: reasons)."""
MaybeText = _Annotated[str, Chars(empty=True)]
"""A string of at most MAX_TEXT_CHARS characters, possibly empty."""
Name = _Annotated[str, Chars(most=MAX_NAME_CHARS)]
"""A non-empty string of at most MAX_NAME_CHARS characters."""
MaybeName = _Annotated[str, Chars(empty=True, most=MAX_NAME_CHARS)]
"""A string of at most MAX_NAME_CHARS characters, possibly empty."""
MaybePath = _Annotated[str, Chars(empty=True, most=MAX_PATH_CHARS)]
"""A path of at most MAX_PATH_CHARS characters, possibly empty."""
Session = _Annotated[str, Length(1, MAX_SESSION_CHARS)]
"""A worker's session secret."""

Constraint = _Callable[[str, _Any], _Any]
"""A check declared on a field's type: called with the field's name and value, it returns the value
(an enum member for a string, see :class:`OneOf`) or raises ValueError saying what is wrong."""


@_dataclasses.dataclass(frozen=True, slots=True)
class FieldSpec:
    """One field of a record as its declared type describes it; the codec compiles these."""

    name: str
    kind: type
    # int, float, bool, str, a StrEnum, tuple (then ``item``) or a Record
    nilable: bool
    # None is a value of this field
    constraints: tuple[Constraint, ...]
    item: "FieldSpec | None" = None
    # the type of a tuple's items


def _spec(name: str, tp: _Any) -> FieldSpec:
    nilable = False
    if _typing.get_origin(tp) in (_typing.Union, _types.UnionType):
        options = [o for o in _typing.get_args(tp) if o is not type(None)]
        if len(options) != 1:  # pragma: no cover - a message declared a union of types
            raise TypeError(f"{name}: only X | None unions are supported, got {tp!r}")
        nilable, tp = True, options[0]
    constraints: list[Constraint] = []
    if _typing.get_origin(tp) is _Annotated:
        tp, *metadata = _typing.get_args(tp)
        constraints.extend(metadata)
    if isinstance(tp, type) and issubclass(tp, _enum.StrEnum):
        constraints.insert(0, OneOf(tp))
        return FieldSpec(name, tp, nilable, tuple(constraints))
    if _typing.get_origin(tp) is tuple:
        item = _spec(name, _typing.get_args(tp)[0])
        return FieldSpec(name, tuple, nilable, tuple(constraints), item)
    if tp in (int, float, bool, str) or (isinstance(tp, type) and issubclass(tp, Record)):
        return FieldSpec(name, tp, nilable, tuple(constraints))
    raise TypeError(f"{name}: a message field cannot be of type {tp!r}")  # pragma: no cover


_FIELDS: dict[type, tuple[FieldSpec, ...]] = {}


def fields_of(cls: type) -> tuple[FieldSpec, ...]:
    """The declared fields of a record (message or part), in order."""
    found = _FIELDS.get(cls)
    if found is None:
        hints = _typing.get_type_hints(cls, include_extras=True)
        fields = _dataclasses.fields(cls)
        found = _FIELDS[cls] = tuple(_spec(f.name, hints[f.name]) for f in fields)
    return found


_Checks = tuple[tuple[str, bool, tuple[Constraint, ...]], ...]
_CHECKS: dict[type, _Checks] = {}


def _checks(cls: type) -> _Checks:
    """The constrained fields of ``cls``: name, whether None is allowed, the constraints."""
    found = _CHECKS.get(cls)
    if found is None:
        found = _CHECKS[cls] = tuple(
            (spec.name, spec.nilable, spec.constraints)
            for spec in fields_of(cls)
            if spec.constraints
        )
    return found


class Record:
    """A frozen dataclass whose fields' constraints are declared on their types."""

    __slots__ = ()

    def __post_init__(self) -> None:
        for name, nilable, constraints in _checks(type(self)):
            value = original = getattr(self, name)
            if value is None and nilable:
                continue
            for constraint in constraints:
                value = constraint(name, value)
            if value is not original:  # a string become its enum member
                object.__setattr__(self, name, value)
        self._validate()

    def _validate(self) -> None:
        """Checks between fields; raises ValueError. Each field's own check is on its type."""


class Message(Record):
    """Any control message."""

    __slots__ = ()


class WorkerMessage(Message):
    """A message a worker sends to the coordinator."""

    __slots__ = ()


class CoordinatorMessage(Message):
    """A message the coordinator sends to a worker."""

    __slots__ = ()


MESSAGE_TYPES: dict[str, type[Message]] = {}
"""Wire name of every message type, filled by :func:`message`; the codec refuses any other."""

TYPE_NAMES: dict[type, str] = {}
"""Each message class's wire name."""

_M = _typing.TypeVar("_M", bound=Message)


def wire_name(class_name: str) -> str:
    """The wire name of a message class: its name in snake case (``OpenStore``: ``open_store``)."""
    return _re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", class_name).lower()


@_typing.dataclass_transform(frozen_default=True)
def message(cls: type[_M]) -> type[_M]:
    """Make ``cls`` a frozen dataclass and register it as the message named after it."""
    if not issubclass(cls, WorkerMessage | CoordinatorMessage):
        raise TypeError(f"{cls.__name__} must derive from WorkerMessage or CoordinatorMessage")
    made = _dataclasses.dataclass(frozen=True, slots=True)(cls)
    fields_of(made)  # a field of a type the codec cannot carry fails here, where it is declared
    name = wire_name(cls.__name__)
    if name in MESSAGE_TYPES:
        raise TypeError(f"two messages are named {name!r}")
    MESSAGE_TYPES[name] = made
    TYPE_NAMES[made] = name
    return made


def names_sent_by(sender: type[Message]) -> tuple[str, ...]:
    """Wire names of the messages ``sender`` (WorkerMessage or CoordinatorMessage) may send."""
    return tuple(name for name, cls in MESSAGE_TYPES.items() if issubclass(cls, sender))
