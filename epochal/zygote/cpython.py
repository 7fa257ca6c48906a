"""Every use epochal makes of CPython's private parts, in one place.

A worker forked by the zygote ends as the interpreter ends (:func:`epochal.zygote.child.end`)
without the interpreter's teardown of the modules it shares with the zygote, and so does by hand
three things ``Py_FinalizeEx`` does that CPython offers no public function for. Each is named
here with what it stands for; ``tests/launch/test_zygote_cpython.py`` fails naming the internal
that a new CPython release changed, and a forked worker's end is checked against a fresh
interpreter's by ``tests/launch/test_zygote.py``. Where one is gone, the zygote still works, less
that step (said for each function).
"""

from __future__ import annotations

import atexit
import threading
import weakref

INTERNALS = (
    (threading, "_shutdown"),
    (atexit, "_run_exitfuncs"),
    (weakref.finalize, "_registry"),
)
"""The private attributes relied on: the object that has each, and its name."""


def wait_for_threads() -> None:
    """Wait for every thread that is not a daemon, as the interpreter does first as it ends
    (``threading._shutdown``, what ``Py_FinalizeEx`` calls; gone: not waited for here, and
    :func:`epochal.zygote.child.end` leaves the rest to the interpreter as it does when a
    daemon thread runs on)."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()


def run_exit_functions() -> None:
    """Run the ``atexit`` callbacks, last registered first, as the interpreter's end does
    (``atexit._run_exitfuncs``; gone: the caller leaves the end to the interpreter)."""
    atexit._run_exitfuncs()


def can_end_by_hand() -> bool:
    """Whether both steps of an interpreter's end this module stands in for are there."""
    return hasattr(threading, "_shutdown") and hasattr(atexit, "_run_exitfuncs")


def disown_finalizers() -> None:
    """Keep the ``weakref.finalize`` callbacks registered so far from running at this process's
    exit (``finalize._registry``; each one's ``atexit`` is public, the registry of them is not;
    gone: they run, as in a forked process that ``multiprocessing`` has not cleared).

    In a forked child they belong to the parent's objects, not the child's copies of them:
    torch registers one per operator library, each of which would unregister its operators at
    the child's exit (``multiprocessing`` clears its own in a forked child the same way)."""
    for finalizer in list(getattr(weakref.finalize, "_registry", ())):
        finalizer.atexit = False
