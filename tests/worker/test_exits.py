"""A worker's excepthook: one line for an error that stops the run, the traceback for the rest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import TracebackType

import pytest

from epochal.errors import CoordinatorLost, CoordinatorUnreachable, JoinRefused, RunAborted
from epochal.worker.control import exits
from epochal.worker.control.exits import one_line


@pytest.mark.parametrize(
    ("exc", "line"),
    [
        (RunAborted("rank 1 has 3 batches"), "epochal: RunAborted: rank 1 has 3 batches"),
        (CoordinatorLost("gone for 15 s"), "epochal: CoordinatorLost: gone for 15 s"),
        (JoinRefused("job 'a', not 'b'"), "epochal: JoinRefused: job 'a', not 'b'"),
        (CoordinatorUnreachable("nobody at x"), "epochal: CoordinatorUnreachable: nobody at x"),
        (ValueError("boom"), None),
        (RuntimeError("index 3 is out of bounds"), None),
        (
            RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1. GLHF!\nmore"),
            "epochal: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1. GLHF! "
            "(this rank lost a peer of the data plane; the rank that failed first says why)",
        ),
    ],
)
def test_errors_that_stop_the_run_are_one_line_others_keep_their_traceback(exc, line):
    assert one_line(exc, abort_reason=None, verbose=False) == line
    assert one_line(exc, abort_reason=None, verbose=True) is None


def test_an_interrupt_names_the_abort_it_followed():
    after = one_line(
        KeyboardInterrupt(), abort_reason="the launcher received SIGINT", verbose=False
    )
    assert (
        after
        == "epochal: KeyboardInterrupt: after the run was aborted: the launcher received SIGINT"
    )
    alone = one_line(KeyboardInterrupt(), abort_reason=None, verbose=False)
    assert alone == "epochal: KeyboardInterrupt: interrupted (EPOCHAL_VERBOSE=1 shows where)"


def test_an_error_raised_while_an_interrupt_unwinds_is_the_interrupt():
    """Ctrl-C inside torch.save ends in the RuntimeError its zip writer's cleanup raises; the
    worker says the interrupt in one line, not that error's traceback."""
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            message = "[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0"
            raise RuntimeError(message)  # noqa: B904 - as a library's cleanup raises it
    except RuntimeError as exc:
        cleanup = exc
    said = one_line(cleanup, abort_reason="the launcher received SIGINT", verbose=False)
    assert said == (
        "epochal: KeyboardInterrupt: after the run was aborted: the launcher received SIGINT"
    )
    assert one_line(RuntimeError("its own"), abort_reason=None, verbose=False) is None


def test_verbose_is_read_from_the_environment():
    assert not exits.is_verbose({})
    assert not exits.is_verbose({"EPOCHAL_VERBOSE": "0"})
    assert exits.is_verbose({"EPOCHAL_VERBOSE": "1"})


def test_the_hook_prints_the_line_or_passes_on(monkeypatch, capsys):
    monkeypatch.delenv("EPOCHAL_VERBOSE", raising=False)
    passed: list[BaseException] = []

    def previous(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        passed.append(value)

    hook = exits.make_hook(previous, lambda: None)
    hook(RunAborted, RunAborted("why"), None)
    error = ValueError("mine")
    hook(ValueError, error, None)
    assert capsys.readouterr().err == "epochal: RunAborted: why\n"
    assert passed == [error]
    monkeypatch.setenv("EPOCHAL_VERBOSE", "1")
    hook(RunAborted, RunAborted("why"), None)
    assert capsys.readouterr().err == "" and len(passed) == 2


def test_install_chains_to_the_previous_hook_once(monkeypatch):
    monkeypatch.setattr(exits, "_installed", False)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    exits.install()
    first = sys.excepthook
    exits.install(aborted=lambda: "second join")
    assert sys.excepthook is first
    assert exits._aborted() == "second join"


SCRIPT = """
import json, os, sys
from epochal import errors
from epochal.worker.control import exits
ended = {}
for name in sys.argv[1:]:  # each in a process of its own, forked after the imports
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its standard error is the pipe; it raises as a script does
        os.close(read)
        os.dup2(write, 2)
        exits.install()
        raise getattr(errors, name)("the reason")
    os.close(write)
    with open(read, encoding="utf-8") as said:
        stderr = said.read()
    ended[name] = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), stderr]
print(json.dumps(ended))
"""
ENDS = {"RunAborted": 1, "JoinRefused": 1, "CoordinatorUnreachable": 69}
"""The errors that end a worker in one line, and the exit status of each."""


@pytest.mark.slow  # a process that imports torch
def test_a_process_ends_with_one_line_and_its_status():
    """An uncaught error ends the process through the interpreter's own top level, as it ends a
    worker's script: one interpreter imports epochal once, and each error ends a process forked
    from it (imports and forks said nothing on its standard error)."""
    env = {k: v for k, v in os.environ.items() if k != "EPOCHAL_VERBOSE"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, *ENDS],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert json.loads(proc.stdout) == {
        name: [status, f"epochal: {name}: the reason\n"] for name, status in ENDS.items()
    }
