"""The preloaded parent of a local run's processes: one process imports torch, the others fork.

Every worker of ``epochal run`` used to start a fresh interpreter and import torch on its own:
about 2.4 s of CPU each (``import torch`` 1.3 s; ``torch._dynamo``, which torch's optimizers import
the first time one is built, 1.0-1.2 s), N times over on one machine, and rank 0's data-plane
store server 1.5 s more, which the other ranks wait for. The zygote imports them once; each
worker is a ``fork`` of it that then runs the user's script as ``python -u SCRIPT ARGS`` would
and ends as the interpreter ends, less the teardown of the modules it shares with the zygote;
rank 0 asks it for its store server the same way. It is Python's own ``multiprocessing``
forkserver with a preload, reduced to what a launcher needs: the standard streams and
descriptors the asker attaches, a session of its own, death with its parent, and the exit status
reported back.

Its parts: :mod:`~epochal.zygote.framing` (the requests and answers on a channel, checked),
:mod:`~epochal.zygote.server` (the zygote's loop, and when it will not fork),
:mod:`~epochal.zygote.child` (the forked child: become the process python would have started,
run the script, end), :mod:`~epochal.zygote.proctitle` (what ``ps`` shows of it),
:mod:`~epochal.zygote.cpython` (the CPython internals it relies on) and
:mod:`~epochal.zygote.forking` (the asking side: a launcher, a worker).

:class:`epochal.launch.preload.Preloaded` starts the zygote as a script, by path (:data:`SCRIPT`:
``python -u -P __main__.py FD PARENT ROOM MODULE...``): it imports nothing of epochal, so that
nothing epochal reads at import time is fixed there for every worker, and loads its own modules
under another name (:mod:`epochal.zygote.__main__`). FD is one end of a ``SOCK_SEQPACKET`` pair
(the launcher holds the other) or a listening Unix socket (``epochal preload SOCKET``); PARENT is
the launcher's pid; ROOM is :data:`ARGV_ROOM` spaces, room for the children's command lines; the
MODULEs are imported before the process says ``ready``. When the launcher's channel closes, the
zygote ends, and every child with it (their death signal).

Fork safety: nothing here starts a thread, touches CUDA or runs an operator before it forks (torch
starts its thread pools and CUDA on first use, in each worker), and the zygote checks before
each fork that no preloaded module did (:func:`epochal.zygote.server.fork_hazard`); the
interpreter reseeds ``random`` in each child, and the child reseeds NumPy's global generator, so
no two workers share a random stream they did not ask to share.
"""

from __future__ import annotations

import os

from .forking import Child, ask, channel_from, connect, popen
from .framing import CHANNEL_ENV, IMPORT_ENV, network_namespace
from .proctitle import ARGV_ROOM, ENV_ROOM, ROOM_ENV
from .server import main

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__main__.py")
"""The file the launcher runs as the zygote."""

__all__ = [
    "ARGV_ROOM",
    "CHANNEL_ENV",
    "ENV_ROOM",
    "IMPORT_ENV",
    "ROOM_ENV",
    "SCRIPT",
    "Child",
    "ask",
    "channel_from",
    "connect",
    "main",
    "network_namespace",
    "popen",
]
