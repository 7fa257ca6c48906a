"""Every exception epochal raises, in one tree.

::

    EpochalError                    anything epochal raises on purpose
    ├── ConfigError                 an argument or flag is out of range (also a ValueError)
    ├── MalformedMessage            bytes that are not exactly one valid message
    │   └── ProtocolVersionMismatch the peer speaks another protocol version
    ├── CoordinatorUnreachable      no coordinator answered before the connect deadline
    ├── JoinRefused                 the coordinator refused this worker at rendezvous
    └── RunAborted                  the run was stopped for every rank; ``reason`` says why
        └── CoordinatorLost         the coordinator vanished and no new one took the worker back

Each message names what is wrong and what to do about it; a caller that only prints ``str(err)``
gives the user enough to act.
"""

from __future__ import annotations


class EpochalError(Exception):
    """Base class of every error epochal raises on purpose."""


class ConfigError(EpochalError, ValueError):
    """An argument, flag or environment variable holds a value that is not allowed."""


class MalformedMessage(EpochalError):
    """Bytes that do not decode to exactly one valid protocol message."""


class ProtocolVersionMismatch(MalformedMessage):
    """The peer speaks another protocol version than this process."""

    def __init__(self, message: str, *, theirs: object, ours: int) -> None:
        super().__init__(message)
        self.theirs = theirs
        self.ours = ours


class CoordinatorUnreachable(EpochalError):
    """No coordinator answered the worker's hello before its connect deadline."""

    exit_code = 69
    """Exit status of a worker process that ends with this uncaught (EX_UNAVAILABLE): a
    supervisor does not restart it, since the next attempt would wait the same way."""


class JoinRefused(EpochalError):
    """The coordinator refused this worker at rendezvous (wrong job, surplus, duplicate, ...)."""


class RunAborted(EpochalError):
    """The run was stopped on every rank.

    ``reason`` is the coordinator's explanation (which rank, what differed, what to change).
    ``needs_fix`` marks a configuration or data error (ranks with different batch counts, a
    ``--monitor`` metric nobody reports, workers with different models): resuming the run repeats
    it, so it is fixed first and the same command then runs; without it the abort is a failure
    (a lost worker, a crash) that resuming from the last checkpoint recovers from.
    """

    def __init__(self, reason: str, *, needs_fix: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.needs_fix = needs_fix


class CoordinatorLost(RunAborted):
    """The coordinator went silent or restarted without this worker.

    Inside :meth:`Session.run_epochs` it starts a re-attach: the worker says hello again and a
    restarted coordinator resumes the run from its last committed checkpoint. Raised to the caller
    only when that fails within the re-attach timeout.
    """
