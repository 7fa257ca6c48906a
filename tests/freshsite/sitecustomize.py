"""Notes each interpreter that starts, for the suite's fresh starts (:mod:`tests.fresh`).

A test that starts its processes fresh puts this directory first on ``PYTHONPATH`` and names a
file in ``EPOCHAL_TEST_STARTS``: every interpreter that then starts (a launcher, its workers, a
store server, a coordinator, torchrun's workers) appends a line there, its pid, parent, command
line and the variables through which it could have a process forked for it. A process forked
from a preloaded one runs no interpreter start, so it writes nothing; the test reads the file
(:func:`tests.fresh.forks`). It imports nothing of epochal, which would fix at start what the
process reads later.
"""

import json
import os
import sys

_path = os.environ.get("EPOCHAL_TEST_STARTS")
if _path:
    _seen = ("EPOCHAL_PRELOAD_SOCKET", "EPOCHAL_ZYGOTE")
    _line = json.dumps(
        {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "argv": sys.orig_argv,
            "env": {name: os.environ[name] for name in _seen if name in os.environ},
        }
    )
    try:
        with open(_path, "a", encoding="utf-8") as _log:
            _log.write(_line + "\n")  # one write, appended: lines of processes never mix
    except OSError:  # a process of another user (setpriv) cannot write here: it goes unnoted
        pass
