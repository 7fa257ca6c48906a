"""Deterministic fault injection for tests (ours and users'): fail at a named point of a run.

Set ``EPOCHAL_FAULT`` in a worker's environment to ``ACTION@POINT[:key=value...]``, e.g.
``kill@checkpoint-commit:rank=0:epoch=1`` or ``raise@train-step:rank=1:epoch=2:step=5``.

Actions: ``kill`` (SIGKILL this process: a crash with no cleanup), ``raise`` (an exception in the
training code), ``exit`` (``os._exit(3)``), ``stop`` (SIGSTOP: the whole process freezes, its
heartbeats too), ``hang`` (the training code blocks for an hour while heartbeats go on: a stall),
``delay`` (the training code sleeps ``ms`` milliseconds, e.g. ``delay@train-step:rank=1:ms=200``).
``drop`` and ``corrupt`` act on the control messages this worker sends at point ``send``: the
message named by ``type=`` (its wire name, one of :data:`MESSAGE_KINDS`) is dropped or replaced by
garbage, e.g. ``drop@send:rank=1:type=epoch_report`` loses rank 1's epoch reports.
Points: ``connect`` (before the data-plane process group is initialised), ``train-step`` (before a
training step), ``valid-step`` (before a validation step; both also know ``world``, the world's
generation: 0 until a rank is lost, so ``kill@train-step:rank=0:world=0`` fires once),
``checkpoint-write`` (every rank, its own file of the checkpoint written, before the collective
save, or the barrier where rank 0 writes in the background), ``checkpoint-commit`` (rank 0, after
every rank wrote the checkpoint, before it is renamed into place; where rank 0 writes it in the
background, on that thread, while the next epoch trains: ``kill``, ``exit`` and ``stop`` act on
the whole process, ``raise`` fails the run at the next boundary), ``epoch-end`` (after the
epoch's report). Without the variable every check is a dict lookup that finds nothing.
"""

from __future__ import annotations

import functools
import os
import signal
import time

from epochal.protocol.messages import WorkerMessage, names_sent_by

FAULT_ENV = "EPOCHAL_FAULT"
ACTIONS = ("kill", "raise", "exit", "stop", "hang", "delay", "drop", "corrupt")
_PARAMETERS = ("ms",)  # settings of the action, not conditions on where it fires
MESSAGE_KINDS = names_sent_by(WorkerMessage)
"""Control messages a ``drop``/``corrupt`` fault can name (``type=epoch_report``): every message
a worker sends, by its wire name."""
POINTS = (
    "connect",
    "train-step",
    "valid-step",
    "checkpoint-write",
    "checkpoint-commit",
    "epoch-end",
    "send",
)


class InjectedFault(RuntimeError):
    """Raised by a ``raise`` fault."""


@functools.cache
def _plan() -> tuple[str, str, dict[str, int | str], dict[str, int]] | None:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return None
    head, *conditions = spec.split(":")
    action, _, point = head.partition("@")
    if action not in ACTIONS or point not in POINTS:
        raise ValueError(
            f"{FAULT_ENV}={spec!r}: expected ACTION@POINT with ACTION one of {ACTIONS} and POINT "
            f"one of {POINTS}"
        )
    where: dict[str, int | str] = {}
    settings: dict[str, int] = {}
    for condition in conditions:
        key, _, value = condition.partition("=")
        if key == "type":
            if value not in MESSAGE_KINDS:
                raise ValueError(
                    f"{FAULT_ENV}={spec!r}: type= names the message a worker sends, one of "
                    f"{', '.join(MESSAGE_KINDS)}; got {value!r}"
                )
            where[key] = value
        elif key in _PARAMETERS:
            settings[key] = int(value)
        else:
            where[key] = int(value)
    return action, point, where, settings


def on_send(kind: str, data: bytes, *, rank: int | None) -> bytes | None:
    """A control frame about to be sent: None to drop it, garbage to corrupt it, else as is."""
    plan = _plan()
    if plan is None or plan[1] != "send" or plan[0] not in ("drop", "corrupt"):
        return data
    action, _, where, _ = plan
    at: dict[str, int | str] = {"type": kind}
    if rank is not None:
        at["rank"] = rank
    if any(at.get(k) != v for k, v in where.items()):
        return data
    return None if action == "drop" else b"\xc1" + data[1:]


def hit(point: str, **at: int) -> None:
    """Fire the configured fault if it names ``point`` and every condition matches ``at``."""
    plan = _plan()
    if plan is None:
        return
    action, wanted, where, settings = plan
    if wanted != point or any(at.get(k) != v for k, v in where.items()):
        return
    match action:
        case "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        case "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        case "exit":
            os._exit(3)
        case "hang":
            time.sleep(3600)
        case "delay":
            time.sleep(settings.get("ms", 100) / 1000)
        case _:
            raise InjectedFault(f"injected fault at {point} {at}")
