"""What the zygote will not do (epochal/zygote/framing.py, server.py): die of a request it cannot
read, taking every worker it forked with it, or fork where a fork is unsafe (a second thread,
CUDA initialized), which the launch is told and answers by starting its workers afresh."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

from epochal import zygote
from epochal.errors import EpochalError
from epochal.launch.preload import Preloaded, serve
from epochal.zygote.framing import MAX_FDS, MESSAGE_BYTES, BadRequest, parse
from epochal.zygote.server import fork_hazard

GOOD: dict[str, Any] = {
    "id": 7,
    "script": "train.py",
    "module": None,
    "args": ["--lr", "0.1"],
    "env": {"PATH": "/usr/bin"},
    "cwd": "/",
    "argv": ["python", "-u", "train.py", "--lr", "0.1"],
    "fds": [1, 2],
    "channel": True,
}

MALFORMED: dict[str, tuple[bytes, int, str]] = {
    # name: (the bytes sent, the descriptors attached, what the error says)
    "not-json": (b'{"id": 1, "script": ', 0, "not JSON"),
    "not-utf8": (b"\xff\xfe{}", 0, "not JSON"),
    "nested-too-deep": (b"[" * 200_000, 0, "not JSON"),
    "a-list": (b"[1, 2]", 0, "a JSON list, not an object"),
    "keys-missing": (json.dumps({"id": 1}).encode(), 0, "neither a script nor a module"),
    "id-a-string": (json.dumps({**GOOD, "id": "7"}).encode(), 2, "'id' is"),
    "script-a-number": (json.dumps({**GOOD, "script": 5}).encode(), 2, "'script' is 5"),
    "both": (json.dumps({**GOOD, "module": "m"}).encode(), 2, "or both"),
    "args-not-strings": (json.dumps({**GOOD, "args": [1]}).encode(), 2, "'args' is [1]"),
    "env-not-strings": (json.dumps({**GOOD, "env": {"A": 1}}).encode(), 2, "'env'"),
    "env-name-with-equals": (json.dumps({**GOOD, "env": {"A=B": "1"}}).encode(), 2, "'env'"),
    "nul-in-cwd": (json.dumps({**GOOD, "cwd": "/\0x"}).encode(), 2, "'cwd' is"),
    "argv-empty": (json.dumps({**GOOD, "argv": []}).encode(), 2, "'argv' is empty"),
    "fds-not-attached": (json.dumps(GOOD).encode(), 0, "places 2 descriptors, and 0 are"),
    "fds-repeated": (json.dumps({**GOOD, "fds": [1, 1]}).encode(), 2, "distinct"),
    "channel-not-bool": (json.dumps({**GOOD, "channel": "yes"}).encode(), 2, "'channel'"),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_a_malformed_request_is_one_bad_request_naming_what_is_wrong(name: str) -> None:
    data, attached, says = MALFORMED[name]
    with pytest.raises(BadRequest) as raised:
        parse(data, attached)
    assert says in str(raised.value)


def test_a_request_cut_short_by_the_socket_is_refused() -> None:
    data = json.dumps(GOOD).encode()
    with pytest.raises(BadRequest, match=f"longer than the {MESSAGE_BYTES} bytes"):
        parse(data, 2, socket.MSG_TRUNC)
    with pytest.raises(BadRequest, match=f"more than the {MAX_FDS} descriptors"):
        parse(data, 2, socket.MSG_CTRUNC)


def test_a_good_request_is_read_with_its_defaults() -> None:
    request = parse(json.dumps({**GOOD, "channel": False}).encode(), 2)
    assert (request.id, request.script, request.module) == (7, "train.py", None)
    assert (request.args, request.fds, request.channel, request.safe_path) == (
        ("--lr", "0.1"),
        (1, 2),
        False,
        False,
    )


@pytest.mark.parametrize(
    ("threads", "tasks", "cuda", "says"),
    [
        (1, 1, False, ""),
        (1, 0, False, ""),  # /proc/self/task unreadable: the Python count alone
        (2, 2, False, "runs 2 threads"),
        (1, 3, False, "runs 3 threads"),  # a thread no Python code started (a library's)
        (1, 1, True, "CUDA is initialized"),
    ],
)
def test_a_fork_is_unsafe_with_a_second_thread_or_cuda(
    threads: int, tasks: int, cuda: bool, says: str
) -> None:
    hazard = fork_hazard(threads=threads, tasks=tasks, cuda=cuda)
    assert (says in hazard) if says else hazard == ""
    if says:
        assert "EPOCHAL_PRELOAD" in hazard  # what to change


def _send(channel: socket.socket, data: bytes, fds: list[int]) -> dict[str, Any]:
    """Send ``data`` with ``fds`` attached and read the answer (within 30 s)."""
    socket.send_fds(channel, [data], fds)
    channel.settimeout(30)
    answer: dict[str, Any] = json.loads(channel.recv(65536))
    return answer


def _oversized(channel: socket.socket) -> bytes:
    """A request longer than the zygote reads, with the send buffer made room for it (root may;
    empty where this process may not)."""
    data = json.dumps({**GOOD, "args": ["x" * MESSAGE_BYTES]}).encode()
    try:
        channel.setsockopt(socket.SOL_SOCKET, 32, 2 * len(data))  # SO_SNDBUFFORCE
    except OSError:
        return b""
    return data


SLEEPS = "import sys, time\nprint('up', flush=True)\ntime.sleep(float(sys.argv[1]))\n"


async def test_malformed_requests_to_a_live_zygote_are_answered_and_its_workers_live_on(
    tmp_path: Path, capfd: Any
) -> None:
    """A shared zygote (``epochal preload``) is sent every kind of malformed request by one
    launch: each is answered with its error on that connection, said once on the zygote's
    standard error, and then that launch's good request forks, while another launch's worker
    lives on."""
    (tmp_path / "sleeps.py").write_text(SLEEPS)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    path = str(tmp_path / "preload.sock")
    server = serve(path, ("json",), env)
    command = [sys.executable, "-u", str(tmp_path / "sleeps.py")]
    try:
        other = await Preloaded.connect(path, ("json",), env)
        kept = await other.spawn([*command, "600"], env)
        assert await kept.stdout.readline() == b"up\n"
        channel, _ = zygote.connect(path, 60)
        null = os.open(os.devnull, os.O_RDONLY)
        try:
            answers = {}
            for name, (data, attached, _) in MALFORMED.items():
                answers[name] = _send(channel, data, [null] * attached)
            answers["too-many-fds"] = _send(channel, json.dumps(GOOD).encode(), [null] * 9)
            oversized = _oversized(channel)
            if oversized:
                answers["oversized"] = _send(channel, oversized, [null, null])
            good = {**GOOD, "script": command[2], "args": ["0"], "argv": [*command, "0"]}
            good.update(env=env, cwd=str(tmp_path), fds=[1, 2], channel=False)
            started = _send(channel, json.dumps(good).encode(), [null, null])
        finally:
            os.close(null)
        for name, answer in answers.items():
            assert set(answer) == {"failed", "error"}, (name, answer)
            assert "cannot serve" in answer["error"], (name, answer)
        assert answers["id-a-string"]["failed"] is None  # no id it could read
        assert answers["script-a-number"]["failed"] == 7
        assert answers["too-many-fds"]["error"].endswith(
            f"more than the {MAX_FDS} descriptors a request may"
        )
        if oversized:
            assert "longer than" in answers["oversized"]["error"]
        assert started.get("started") == 7 and started.get("pid"), started
        channel.close()
        assert server.poll() is None  # the zygote serves on
        assert kept.returncode is None
        os.kill(kept.pid, 0)  # and the other launch's worker lives
        other.close()  # until that launch ends: then it is killed, and its output ends
        # read to its end, so its pipe is closed here and not left to this loop's end (or, left
        # unread, to the garbage collector in some later test)
        assert await asyncio.wait_for(kept.stdout.read(), 60) == b""
    finally:
        server.kill()
        server.wait()
    said = [line for line in capfd.readouterr().err.splitlines() if "was sent" in line]
    assert len(said) == 1, said  # once for that connection, not once a request
    assert "a request it cannot serve" in said[0]


THREAD = """\
import threading, time
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
"""
LATER = """\
import os, threading, time
def start():
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
os.register_at_fork(after_in_parent=start)  # a thread once the first worker is forked
"""
CUDA = "class cuda:\n    @staticmethod\n    def is_initialized():\n        return True\n"


@pytest.fixture
def modules(tmp_path: Path) -> dict[str, str]:
    """An environment whose path has ``starts_a_thread``, ``starts_one_later`` and a ``torch``
    that says CUDA is initialized."""
    found = tmp_path / "found"
    (found / "torch").mkdir(parents=True)
    (found / "starts_a_thread.py").write_text(THREAD)
    (found / "starts_one_later.py").write_text(LATER)
    (found / "torch" / "__init__.py").write_text(CUDA)
    (tmp_path / "exits.py").write_text("print('ran')\n")
    path = os.pathsep.join(p for p in (str(found), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


@pytest.mark.parametrize(
    ("module", "says"),
    [("starts_a_thread", "runs 2 threads"), ("torch", "CUDA is initialized")],
)
async def test_a_zygote_whose_module_started_a_thread_or_cuda_does_not_fork(
    tmp_path: Path, modules: dict[str, str], module: str, says: str
) -> None:
    preloaded = Preloaded.start((module,), modules)
    try:
        assert await preloaded.ready()
        for _ in range(2):  # each time it is asked
            with pytest.raises(EpochalError, match=f"could not fork a worker: .*{says}"):
                await preloaded.spawn([sys.executable, "-u", str(tmp_path / "exits.py")], modules)
    finally:
        preloaded.close()


async def test_a_thread_started_after_a_fork_stops_the_next_one(
    tmp_path: Path, modules: dict[str, str]
) -> None:
    preloaded = Preloaded.start(("starts_one_later",), modules)
    command = [sys.executable, "-u", str(tmp_path / "exits.py")]
    try:
        assert await preloaded.ready()
        first = await preloaded.spawn(command, modules)
        assert await first.stdout.read() == b"ran\n" and await first.wait() == 0
        with pytest.raises(EpochalError, match="runs 2 threads"):
            await preloaded.spawn(command, modules)
    finally:
        preloaded.close()


async def test_an_asker_that_reads_no_answer_is_dropped_not_waited_for(tmp_path: Path) -> None:
    """Requests sent without reading an answer fill the asker's queue: the shared zygote drops
    that connection rather than wait to write to it, and serves the next launch."""
    (tmp_path / "exits.py").write_text("print('ran')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    path = str(tmp_path / "preload.sock")
    server = serve(path, ("json",), env)
    try:
        channel, _ = zygote.connect(path, 60)
        channel.settimeout(30)
        sent = 0
        with pytest.raises(OSError):  # the zygote closed it: the send is refused
            while sent < 100_000:
                channel.send(b"not json")
                sent += 1
        channel.close()
        assert sent > 10  # it took many before the queue of answers was full
        preloaded = await Preloaded.connect(path, ("json",), env)
        try:
            forked = await preloaded.spawn([sys.executable, "-u", str(tmp_path / "exits.py")], env)
            assert await forked.stdout.read() == b"ran\n"
        finally:
            preloaded.close()
        assert server.poll() is None
    finally:
        server.kill()
        server.wait()
