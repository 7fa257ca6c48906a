"""The CPython internals the zygote's forked children rely on (epochal/zygote/cpython.py) are
there and do what they are used for: a failure names the one a new CPython release changed."""

from __future__ import annotations

import subprocess
import sys
import weakref

import pytest

from epochal.zygote import cpython


@pytest.mark.parametrize(
    ("owner", "name"), cpython.INTERNALS, ids=[name for _, name in cpython.INTERNALS]
)
def test_each_internal_relied_on_is_there(owner: object, name: str) -> None:
    where = getattr(owner, "__qualname__", getattr(owner, "__name__", repr(owner)))
    assert hasattr(owner, name), (
        f"{where}.{name} is gone in Python {sys.version.split()[0]}: "
        "epochal/zygote/cpython.py needs another way to do what it stands for"
    )


def test_the_finalizer_registry_holds_each_finalizer_and_its_atexit_is_kept() -> None:
    class Held:
        pass

    held = Held()
    finalizer = weakref.finalize(held, print, "never")
    try:
        registry = weakref.finalize._registry  # type: ignore[attr-defined]
        assert finalizer in registry, (
            "weakref.finalize._registry no longer holds the live finalizers: "
            "cpython.disown_finalizers disowns nothing"
        )
        cpython.disown_finalizers()
        assert finalizer.atexit is False
    finally:
        finalizer.detach()


ENDS = """\
import atexit, threading, time
from epochal.zygote import cpython
said = []
atexit.register(said.append, "atexit")
threading.Thread(target=lambda: (time.sleep(0.2), said.append("thread"))).start()
cpython.wait_for_threads()
cpython.run_exit_functions()
print(",".join(said), flush=True)
"""


def test_the_ends_of_an_interpreter_wait_for_its_threads_and_run_its_atexit_callbacks() -> None:
    """In a process of its own: the test process's own callbacks are not for running here."""
    done = subprocess.run(
        [sys.executable, "-c", ENDS], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "thread,atexit\n", (
        "threading._shutdown no longer waits for the threads, or atexit._run_exitfuncs no "
        f"longer runs the callbacks (or runs them twice): {done.stdout!r} {done.stderr!r}"
    )
    assert cpython.can_end_by_hand()
