"""The launcher's output prefixing and the CLI's argument handling, without starting workers."""

from __future__ import annotations

import asyncio
import functools
import io
import os
import socket
import subprocess
import sys

import pytest

from epochal.cli.parser import build_parser
from epochal.launch.attempt import hidden_note, worker_environment
from epochal.launch.plainscript import free_port, listening, made_its_own_group
from epochal.launch.processes import ORPHAN_EXIT_CODE, die_with_parent
from epochal.launch.restarts import Outcome, restarting
from epochal.output import PEER_LOST, Kind, RankStream, Relay, classify, in_words


def test_prefixer_splits_lines_and_keeps_carriage_returns():
    out = io.StringIO()
    p = RankStream("[rank 1] ", out)
    p.feed("hel")
    assert out.getvalue() == ""
    p.feed("lo\nbar 1\rbar 2\rdone\n\ntail")
    p.close()
    assert out.getvalue() == (
        "[rank 1] hello\n[rank 1] bar 1\r[rank 1] bar 2\r[rank 1] done\n[rank 1] \n[rank 1] tail\n"
    )


def test_parser_requires_world_size_and_validates_numbers():
    parser = build_parser()
    args = parser.parse_args(["run", "--nproc", "2", "s.py", "--lr", "0.1"])
    assert (args.nproc, args.script, args.script_args) == (2, "s.py", ["--lr", "0.1"])
    with pytest.raises(SystemExit):
        parser.parse_args(["coordinator"])
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "--nproc", "2", "--rendezvous-timeout", "-1", "s.py"])


def test_cli_does_not_import_torch():
    code = (
        "import sys, epochal.cli.parser, epochal.launch.launcher, epochal.launch.supervisor, "
        "epochal.coordinator; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _traceback(rank: int, exception: str) -> str:
    return (
        f"[rank{rank}]: Traceback (most recent call last):\n"
        f'[rank{rank}]:   File "train.py", line 3, in <module>\n'
        f"[rank{rank}]:     main()\n"
        f"[rank{rank}]: {exception}\n"
    )


def test_relay_shows_the_users_traceback_once_and_hides_the_consequences():
    out = io.StringIO()
    relay = Relay(out)
    r0, r1, r2 = (relay.stream(f"[rank {i}] ") for i in range(3))
    r0.feed("epoch line\n")
    r1.feed(_traceback(1, "ValueError: boom"))
    r0.feed(_traceback(0, "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1"))
    r2.feed(_traceback(2, "ValueError: boom"))  # the same exception again: shown once
    assert out.getvalue() == "[rank 0] epoch line\n"  # tracebacks wait for the workers' end
    relay.stop()
    r0.feed("teardown chatter\n")
    for r in (r0, r1, r2):
        r.close()
    relay.release()
    assert out.getvalue() == "[rank 0] epoch line\n" + "".join(
        f"[rank 1] {line}\n" for line in _traceback(1, "ValueError: boom").splitlines()
    )
    assert relay.hidden == (4 + 1) + 4  # rank 0 (its traceback, then the chatter), rank 2


def test_relay_turns_an_epochal_error_into_one_line_unless_the_coordinator_said_it():
    out = io.StringIO()
    relay = Relay(out)
    a, b = relay.stream("[rank 0] "), relay.stream("[rank 1] ")
    a.feed(_traceback(0, "epochal.errors.RunAborted: rank 1 has 3 batches"))
    b.feed(_traceback(1, "epochal.errors.JoinRefused: the workers' models differ"))
    a.close()
    b.close()
    relay.release(known_reasons="rank 1 has 3 batches")
    assert out.getvalue() == "[rank 1] epochal.errors.JoinRefused: the workers' models differ\n"


def test_relay_judges_a_workers_one_line_like_the_traceback_it_replaces():
    out = io.StringIO()
    relay = Relay(out)
    r0, r1, r2 = (relay.stream(f"[rank {i}] ") for i in range(3))
    r0.feed("[rank0]: epochal: RunAborted: rank 1 has 3 batches\n")  # before the run stops
    r1.feed("epochal: KeyboardInterrupt: after the run was aborted: rank 1 has 3 batches\n")
    r2.feed("epochal: JoinRefused: the workers' models differ\n")
    r3 = relay.stream("[rank 3] ")
    r3.feed("[rank3]: epochal: RuntimeError: [pair.cc:553] Connection closed by peer (...)\n")
    assert out.getvalue() == ""  # held like a traceback until the workers have ended
    for r in (r0, r1, r2, r3):
        r.close()
    relay.release(known_reasons="rank 1 has 3 batches")
    assert out.getvalue() == "[rank 2] epochal.errors.JoinRefused: the workers' models differ\n"
    assert relay.hidden == 3
    # the abort's reason said rank 3's RuntimeError is in its output: the last line says where
    assert relay.hidden_causes == ["RuntimeError"]
    assert hidden_note(relay.hidden, relay.hidden_causes) == (
        "; 3 lines of worker output are hidden, the RuntimeError the reason points to among "
        "them (--verbose shows them)"
    )


def test_relay_shows_a_cause_the_coordinator_did_not_give_once():
    out = io.StringIO()
    relay = Relay(out)
    r0, r1 = relay.stream("[rank 0] "), relay.stream("[rank 1] ")
    r0.feed("epochal: RunAborted: the coordinator stopped\n")
    r1.feed(_traceback(1, "epochal.errors.RunAborted: the coordinator stopped"))
    r0.close()
    r1.close()
    relay.release()
    assert out.getvalue() == "[rank 0] epochal.errors.RunAborted: the coordinator stopped\n"


def test_relay_hides_keyboard_interrupts_and_shows_everything_when_verbose():
    for verbose, expected in ((False, ""), (True, _traceback(0, "KeyboardInterrupt"))):
        out = io.StringIO()
        relay = Relay(out, verbose=verbose)
        stream = relay.stream("")
        stream.feed(_traceback(0, "KeyboardInterrupt"))
        stream.close()
        relay.release()
        assert out.getvalue() == expected


def test_chained_exceptions_are_judged_by_the_last_one():
    out = io.StringIO()
    relay = Relay(out)
    stream = relay.stream("")
    stream.feed(
        _traceback(0, "KeyboardInterrupt")
        + "\nDuring handling of the above exception, another exception occurred:\n\n"
        + _traceback(0, "OSError: disk full")
    )
    stream.close()
    relay.release()
    assert "OSError: disk full" in out.getvalue() and "KeyboardInterrupt" in out.getvalue()
    assert classify("OSError: disk full") is Kind.USER
    assert classify("epochal.errors.CoordinatorLost: gone") is Kind.EPOCHAL


def test_a_traceback_says_its_rank_once():
    for verbose in (False, True):
        out = io.StringIO()
        relay = Relay(out, verbose=verbose)
        own, other = relay.stream("[rank 1] ", rank=1), relay.stream("[rank 2] ", rank=2)
        own.feed(_traceback(1, "ValueError: boom"))
        other.feed(_traceback(3, "ValueError: bang"))  # the coordinator made local worker 2 rank 3
        own.close()
        other.close()
        relay.release()
        shown = out.getvalue().splitlines()
        assert "[rank 1] Traceback (most recent call last):" in shown
        assert "[rank 1] ValueError: boom" in shown
        assert not any(line.startswith("[rank 1] [rank1]") for line in shown)
        assert "[rank 2] [rank3]: ValueError: bang" in shown  # another rank's word is kept


def test_the_hidden_lines_are_counted_in_words():
    assert hidden_note(0) == ""
    assert hidden_note(1) == (
        "; 1 line of worker output that follows from it is hidden (--verbose shows it)"
    )
    assert hidden_note(7) == (
        "; 7 lines of worker output that follow from it are hidden (--verbose shows them)"
    )
    assert hidden_note(1, ["RuntimeError"]) == (
        "; 1 line of worker output is hidden, the RuntimeError the reason points to "
        "(--verbose shows it)"
    )


@pytest.mark.parametrize(
    ("line", "words"),
    [
        (
            "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
            "closed by peer [127.0.0.1]:12345",
            PEER_LOST,
        ),
        (
            "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
            "[127.0.0.1]:4821: Connection reset by peer. This is typically caused by a remote "
            "worker hanging or bugs in the application. GLHF! \U0001f3d6\ufe0f",
            PEER_LOST,
        ),
        ("torch.distributed.DistBackendError: [pair.cc:1] Write error: Broken pipe", PEER_LOST),
        (
            "DistBackendError: NCCL error: remote process exited or there was a network error",
            PEER_LOST,
        ),
        ("BrokenPipeError: [Errno 32] Broken pipe", None),  # the user's own pipe
        ("ValueError: boom", None),
        ("RuntimeError: Connection closed", None),
    ],
)
def test_a_lost_data_plane_peer_is_said_in_words(line: str, words: str | None):
    assert in_words(line) == words


def test_workers_get_torchruns_variables_beside_epochals():
    env = worker_environment({"PATH": "/bin"}, 1, 3, "run/local-1", 29512)
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")
    assert {k: env[k] for k in (*names, "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "3",
        "LOCAL_WORLD_SIZE": "3",
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29512",
    }
    assert (env["EPOCHAL_RANK"], env["EPOCHAL_WORKER_ID"], env["PATH"]) == (
        "1",
        "run/local-1",
        "/bin",
    )
    assert "TORCHELASTIC_RUN_ID" not in env  # that would claim a real torchrun launch


@pytest.mark.parametrize("orphaned", [False, True])
def test_a_worker_whose_launcher_died_while_starting_it_leaves(orphaned):
    # the child's parent is this process; an orphaned child sees another parent (the reaper),
    # which is what "expected parent" differing from getppid() stands for here
    expected = os.getppid() if orphaned else os.getpid()
    proc = subprocess.run(
        [sys.executable, "-c", "pass"],
        preexec_fn=functools.partial(die_with_parent, expected),
        timeout=60,
    )
    assert proc.returncode == (ORPHAN_EXIT_CODE if orphaned else 0)


def test_run_takes_verbose_and_an_exit_timeout():
    parser = build_parser()
    args = parser.parse_args(["run", "--nproc", "2", "s.py"])
    assert (args.verbose, args.exit_timeout) == (False, None)  # no bound after a finish
    args = parser.parse_args(["run", "--nproc", "2", "--verbose", "--exit-timeout", "30", "s.py"])
    assert (args.verbose, args.exit_timeout) == (True, 30.0)
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "--nproc", "2", "--exit-timeout", "0", "s.py"])


def run_restarting(outcomes: list[Outcome], max_restarts: int) -> tuple[int, list[str]]:
    """Drive the restart loop with ``outcomes`` for successive attempts; what it said."""
    said: list[str] = []

    async def attempt(n: int) -> Outcome:
        said.append(f"attempt {n}")
        return outcomes[n]

    async def restart(n: int, failed: Outcome) -> None:
        said.append(f"restart {n} after {failed.reason}")

    def give_up(failed: Outcome) -> None:
        said.append(f"gave up after {failed.reason}")

    status = asyncio.run(restarting(attempt, max_restarts, restart=restart, give_up=give_up))
    return status, said


FAILED = Outcome(1, "boom", retry=True)


def test_the_restart_loop_retries_a_failure_until_one_attempt_ends_it():
    assert run_restarting([FAILED, FAILED, Outcome(0)], 3) == (
        0,
        ["attempt 0", "restart 1 after boom", "attempt 1", "restart 2 after boom", "attempt 2"],
    )
    # a final outcome (a signal, an unreachable coordinator) is not retried, restarts or not
    assert run_restarting([Outcome(143, "SIGTERM")], 3) == (143, ["attempt 0"])


def test_the_restart_loop_gives_up_with_the_last_failures_status():
    last = Outcome(3, "status 3", retry=True)
    assert run_restarting([FAILED, last], 1) == (
        3,
        ["attempt 0", "restart 1 after boom", "attempt 1", "gave up after status 3"],
    )
    assert run_restarting([FAILED], 0) == (1, ["attempt 0"])  # no restarts: nothing to give up


def test_a_listener_on_the_master_port_is_seen_and_nothing_else_is():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        port = server.getsockname()[1]
        assert not listening(port)  # bound, not listening: no process group store yet
        server.listen()
        assert listening(port)
        assert listening(port, [os.getpid()])  # held by this process
    assert not listening(port)
    assert not listening(free_port())


HOLDS_A_SOCKET = (
    "import socket, time\n"
    "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
    "print('bound', flush=True); time.sleep(60)"
)


def test_a_listener_that_is_not_a_workers_is_not_their_process_group(tmp_path):
    # the free port handed to the workers may be taken meanwhile by any other process (another
    # run's store): only a socket one of the workers holds says the script made its own group
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        holder = subprocess.Popen(  # a worker that holds a socket, but not the one listening
            [sys.executable, "-c", HOLDS_A_SOCKET], stdout=subprocess.PIPE, text=True
        )
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "bound\n"
            assert listening(port)
            assert not listening(port, [worker.pid])
            assert not listening(port, [holder.pid])
            assert not listening(port, [])
            looks = iter(range(5))  # five looks, then a hello came
            possible = functools.partial(next, looks, None)
            seen = asyncio.run(
                made_its_own_group(port, lambda: possible() is not None, [worker.pid], 0.01)
            )
            assert seen is False
        finally:
            worker.kill()
            holder.kill()
            worker.wait()
            holder.communicate()
            worker.wait()


def test_the_master_port_is_watched_only_while_no_worker_has_said_hello():
    port = free_port()
    calls = []

    def possible() -> bool:
        calls.append(1)
        return len(calls) < 3  # a hello arrives before anything listens

    assert asyncio.run(made_its_own_group(port, possible, [os.getpid()], 0.01)) is False
    assert len(calls) == 3
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))
        server.listen()
        assert asyncio.run(made_its_own_group(port, lambda: True, [os.getpid()], 0.01)) is True
