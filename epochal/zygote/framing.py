"""What travels on a zygote's channels, and who is at their other end.

A channel is a ``SOCK_SEQPACKET`` Unix socket: one message a packet, JSON, descriptors attached
(``SCM_RIGHTS``). An asker sends a request to fork::

    {"id": 1, "script": PATH | null, "module": NAME | null, "args": [...], "env": {...},
     "cwd": DIR, "argv": ["python", "-u", PATH, ...], "fds": [1, 2], "channel": true,
     "safe_path": false}

(``fds``: the descriptor number each attached one becomes in the child, as many as are
attached; standard input is ``/dev/null`` unless one becomes 0; ``channel`` and ``safe_path``
may be left out, false), and the zygote answers ``{"started": ID, "pid": PID}`` or ``{"failed":
ID, "error": WHY}`` (ID null where the request had none it could read), later ``{"exited": PID,
"status": N}`` (N as ``Popen.returncode`` gives it: negative for a signal). A launch connecting
to a shared zygote is first greeted with ``{"ready": true, "executable", "modules", "env",
"netns"}``.

:func:`parse` turns the bytes of a request into exactly one :class:`Request` or raises
:class:`BadRequest` saying what is wrong with it, before anything of it is used: a request the
zygote cannot read is answered, never a crash of the process every worker of every launch it
serves dies with.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import struct
from typing import Any

CHANNEL_ENV = "EPOCHAL_ZYGOTE"
"""``FD:PID``: a forked worker's channel to the process it was forked from (PID)."""

MESSAGE_BYTES = 1 << 20
"""The largest request read (a worker's environment, its arguments); a longer one is refused."""
MAX_FDS = 8
"""The most descriptors one request attaches; a request with more is refused."""

IMPORT_ENV = ("PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "LOGLEVEL")
"""Variables read as the preloaded modules are imported (torch sizes its thread pools from
``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS``; ``torch.distributed.checkpoint`` sets the level of
torch's elastic loggers from ``LOGLEVEL``): a launch whose values differ does not use a shared
zygote imported with others."""


class BadRequest(ValueError):
    """A request the zygote cannot serve as it is: the message says what is wrong with it."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Request:
    """One request to fork, checked: the child runs ``script`` or ``module`` with ``args``."""

    id: int | None
    # what the answers name it by (the askers' own numbering)
    script: str | None
    # a script's path, as given; exactly one of script and module is set
    module: str | None
    # a module's name, as ``python -m`` takes it
    args: tuple[str, ...]
    # the arguments after the script or module
    env: dict[str, str]
    # the child's whole environment
    cwd: str
    # the child's working directory
    argv: tuple[str, ...]
    # the command line ``ps`` shows for the child
    fds: tuple[int, ...]
    # the descriptor number each attached descriptor becomes in the child, in order
    channel: bool = False
    # whether the child gets a channel of its own to the zygote (CHANNEL_ENV)
    safe_path: bool = False
    # ``python -P``: the script's directory is not put first on sys.path


def parse(data: bytes, attached: int, flags: int = 0) -> Request:
    """The request in ``data``, which came with ``attached`` descriptors and the ``recvmsg``
    ``flags``; BadRequest naming what is wrong with it."""
    if flags & socket.MSG_TRUNC:
        raise BadRequest(f"it is longer than the {MESSAGE_BYTES} bytes a request may have")
    if flags & socket.MSG_CTRUNC:
        raise BadRequest(f"it attaches more than the {MAX_FDS} descriptors a request may")
    try:
        message = json.loads(data)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise BadRequest(f"it is not JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(message, dict):
        raise BadRequest(f"it is a JSON {type(message).__name__}, not an object")
    request_id = message.get("id")
    if request_id is not None and not _is_int(request_id):
        raise BadRequest(f"'id' is {_shown(request_id)}, not an integer")
    script = _optional_text(message, "script")
    module = _optional_text(message, "module")
    if (script is None) == (module is None):
        raise BadRequest("it names neither a script nor a module, or both: give one of them")
    fds = _list(message, "fds", int)
    if len(fds) != attached:
        raise BadRequest(f"'fds' places {len(fds)} descriptors, and {attached} are attached")
    if any(fd < 0 or fd > 1023 for fd in fds) or len(set(fds)) != len(fds):
        raise BadRequest(f"'fds' is {fds}: give distinct descriptor numbers from 0 to 1023")
    argv = _list(message, "argv", str)
    if not argv:
        raise BadRequest("'argv' is empty: give the command line ps is to show for the child")
    env = message.get("env")
    if not isinstance(env, dict) or not all(
        _is_text(key) and key and "=" not in key and _is_text(value) for key, value in env.items()
    ):
        raise BadRequest("'env' is not an object of variable names (no '=') to strings")
    return Request(
        id=request_id,
        script=script,
        module=module,
        args=tuple(_list(message, "args", str)),
        env=env,
        cwd=_text(message, "cwd"),
        argv=tuple(argv),
        fds=tuple(fds),
        channel=_flag(message, "channel"),
        safe_path=_flag(message, "safe_path"),
    )


def request_id(data: bytes) -> int | None:
    """The id of a request that :func:`parse` refused, where it has one to read."""
    try:
        message = json.loads(data)
    except (ValueError, RecursionError):
        return None
    found = message.get("id") if isinstance(message, dict) else None
    return found if _is_int(found) else None


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message).encode()


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_text(value: object) -> bool:
    """A string a process can be given: no NUL (which no argument nor variable can hold)."""
    return isinstance(value, str) and "\0" not in value


def _shown(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _text(message: dict[str, Any], key: str) -> str:
    value = message.get(key)
    if not _is_text(value) or not value:
        raise BadRequest(f"{key!r} is {_shown(value)}, not a string")
    return str(value)


def _optional_text(message: dict[str, Any], key: str) -> str | None:
    return None if message.get(key) is None else _text(message, key)


def _flag(message: dict[str, Any], key: str) -> bool:
    value = message.get(key, False)
    if not isinstance(value, bool):
        raise BadRequest(f"{key!r} is {_shown(value)}, not true or false")
    return value


def _list(message: dict[str, Any], key: str, kind: type) -> list[Any]:
    value = message.get(key)
    check = _is_int if kind is int else _is_text
    if not isinstance(value, list) or not all(check(item) for item in value):
        name = "integers" if kind is int else "strings"
        raise BadRequest(f"{key!r} is {_shown(value)}, not a list of {name}")
    return value


def peer(channel: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of the process at the other end of a Unix socket."""
    creds = channel.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    return pid, uid


def network_namespace() -> str:
    """This process's network namespace (``net:[INODE]``; '' where it cannot be read): a child
    forked here listens and connects in it, whatever the asker's is."""
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return ""
