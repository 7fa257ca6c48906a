"""The preloaded process ``epochal run`` forks its workers from (epochal/zygote/) and the
launcher's side of it (epochal/launch/preload.py): a forked worker is the process ``python -u
SCRIPT ARGS`` would have been, and a worker can have the zygote fork a process of its own.

The zygote here preloads nothing (or the standard library), so these tests cost no torch import;
the integration tests run every ``epochal run`` through it with torch preloaded."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from epochal import zygote
from epochal.environment import PRELOAD_SOCKET_ENV
from epochal.errors import ConfigError
from epochal.launch.preload import (
    DEFAULT_PRELOAD,
    Preload,
    Preloaded,
    parse_command,
    preload_modules,
    serve,
)
from epochal.zygote import CHANNEL_ENV, channel_from
from tests.integration.conftest import cmdline
from tests.security.other_user import (
    AS_OTHER_USER,
    OTHER_UID,
    as_other_user,
    needs_root,
    shared_scratch,
)

REPORT = """\
import json, os, random, signal, sys
print(json.dumps({
    "name": __name__,
    "file": __file__,
    "argv": sys.argv,
    "path0": sys.path[0],
    "cwd": os.getcwd(),
    "env": {k: v for k, v in os.environ.items() if k != "EPOCHAL_ZYGOTE"},
    "has_channel": "EPOCHAL_ZYGOTE" in os.environ,
    "sid": os.getsid(0) == os.getpid(),
    "stdin": sys.stdin.read(),
    "comm": open("/proc/self/comm").read().strip(),
    "cmdline": open("/proc/self/cmdline", "rb").read().decode().rstrip("\\0").split("\\0"),
    "environ": [e for e in open("/proc/self/environ", "rb").read().decode().split("\\0")
                if e and not e.startswith("EPOCHAL_ZYGOTE=")],
    "random": random.random(),
    "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
}))
"""


async def run_forked(
    preloaded: Preloaded, command: list[str], env: dict[str, str] | None = None
) -> tuple[int, str]:
    """Fork ``command`` from ``preloaded``; its exit status and everything it printed."""
    forked = await preloaded.spawn(command, env or {"PATH": os.environ.get("PATH", "")})
    out = await forked.stdout.read()
    return await forked.wait(), out.decode()


async def started(modules: tuple[str, ...] = ()) -> Preloaded:
    preloaded = Preloaded.start(modules, dict(os.environ))
    assert await preloaded.ready()
    return preloaded


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "scripts" / "report.py"
    path.parent.mkdir()
    path.write_text(REPORT)
    return path


async def test_a_forked_worker_is_the_process_python_would_have_started(
    script: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    preloaded = await started()
    try:
        env = {"PATH": os.environ.get("PATH", ""), "ONLY_THIS": "1"}
        command = [sys.executable, "-u", str(script), "--lr", "0.1"]
        status, out = await run_forked(preloaded, command, env)
        link = tmp_path / "linked"
        link.symlink_to(script.parent)
        command2 = [sys.executable, "-u", str(link / "report.py")]
        second = json.loads((await run_forked(preloaded, command2, env))[1])
    finally:
        preloaded.close()
    assert status == 0, out
    seen = json.loads(out)
    assert seen["name"] == "__main__"
    assert seen["file"] == str(script)
    assert seen["argv"] == [str(script), "--lr", "0.1"]
    assert seen["path0"] == str(script.parent)
    assert seen["cwd"] == str(tmp_path)
    assert seen["env"] == env  # its own environment, nothing of the zygote's
    assert seen["has_channel"]  # and a channel to ask for processes of its own
    assert seen["sid"]  # a session (and a process group to kill) of its own
    assert seen["stdin"] == ""  # /dev/null
    assert seen["sigint"]  # Ctrl-C raises KeyboardInterrupt, as in any script
    assert seen["comm"] == "python"
    # what ps and pgrep -f show (setproctitle writes it as one string: spaces, not NULs, apart)
    assert " ".join(seen["cmdline"]) == " ".join(command)
    assert seen["environ"] == [f"{k}={v}" for k, v in env.items()]  # and /proc/PID/environ
    assert seen["random"] != second["random"]  # each worker seeds its own random stream
    # a script reached through a link: its own path as given, its real directory on the path
    assert (second["file"], second["path0"]) == (str(link / "report.py"), str(script.parent))


async def test_exit_statuses_and_tracebacks_are_the_interpreters(tmp_path: Path) -> None:
    cases: dict[str, tuple[str, int]] = {
        "exits.py": ("import sys\nsys.exit(3)\n", 3),
        "says.py": ("import sys\nsys.exit('a message')\n", 1),
        "raises.py": ("def f():\n    raise ValueError('boom')\nf()\n", 1),
        "syntax.py": ("def (:\n", 1),
        "interrupted.py": ("raise KeyboardInterrupt\n", -signal.SIGINT),
        "killed.py": ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", -9),
    }
    preloaded = await started()
    results: dict[str, tuple[int, str]] = {}
    try:
        for name, (source, _) in cases.items():
            (tmp_path / name).write_text(source)
            results[name] = await run_forked(
                preloaded, [sys.executable, "-u", str(tmp_path / name)]
            )
    finally:
        preloaded.close()
    assert {name: status for name, (status, _) in results.items()} == {
        name: status for name, (_, status) in cases.items()
    }
    assert results["says.py"][1] == "a message\n"
    raised = results["raises.py"][1]
    assert raised.startswith("Traceback (most recent call last):\n")
    assert raised.count('File "') == 2  # the script's two frames, none of the zygote's
    assert "zygote" not in raised and "runpy" not in raised
    assert raised.rstrip().endswith("ValueError: boom")
    assert "SyntaxError" in results["syntax.py"][1]
    assert "zygote" not in results["syntax.py"][1]
    assert "KeyboardInterrupt" in results["interrupted.py"][1]


ENDS = """\
import atexit, sys, tempfile, threading, time, weakref
log = open(sys.argv[1] + "/log", "w")  # never closed: flushed and closed as the process ends
log.write("written at the start\\n")
temporary = tempfile.NamedTemporaryFile(dir=sys.argv[1], prefix="removed-")  # and removed
class Held:
    pass
held = Held()
weakref.finalize(held, print, "its finalizer ran")
def later():
    time.sleep(0.3)
    print("the thread ended")
threading.Thread(target=later).start()  # not a daemon: waited for
atexit.register(print, "atexit ran")
if sys.argv[2:] == ["daemon"]:  # a thread still running as the interpreter ends
    threading.Thread(target=lambda: [time.sleep(0.001) for _ in iter(int, 1)], daemon=True).start()
print("the script ended")
sys.exit(4)
"""


@pytest.mark.parametrize("daemon", [False, True], ids=["threads-ended", "a-daemon-thread-runs"])
async def test_a_forked_worker_ends_as_the_interpreter_ends(tmp_path: Path, daemon: bool) -> None:
    """What the interpreter does as it ends (its threads waited for, ``atexit``, the script's
    finalizers, open files flushed and closed, temporary files removed, the status), the forked
    worker does, though it leaves the teardown of what it shares with the zygote undone (with a
    daemon thread still running, it leaves all of it to the interpreter)."""
    (tmp_path / "ends.py").write_text(ENDS)
    fresh, forked = tmp_path / "fresh", tmp_path / "forked"
    fresh.mkdir()
    forked.mkdir()
    env = {"PATH": os.environ.get("PATH", "")}
    command = [sys.executable, "-u", str(tmp_path / "ends.py")]
    extra = ["daemon"] if daemon else []
    python = subprocess.run(
        [*command, str(fresh), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    preloaded = await started()
    try:
        status, out = await run_forked(preloaded, [*command, str(forked), *extra], env)
    finally:
        preloaded.close()
    assert python.returncode == 4 and python.stderr == "", python
    assert (status, out) == (python.returncode, python.stdout)
    assert out == "the script ended\nthe thread ended\natexit ran\nits finalizer ran\n"
    # the same files left, with the same in them (a temporary file's name is random: its prefix
    # is compared); where no thread runs on, the log was flushed and the temporary file removed
    left = sorted(p.name[:8] for p in forked.iterdir())
    assert left == sorted(p.name[:8] for p in fresh.iterdir())
    assert (forked / "log").read_text() == (fresh / "log").read_text()
    if not daemon:
        assert left == ["log"] and (forked / "log").read_text() == "written at the start\n"


async def test_a_module_runs_as_python_m_runs_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "tool.py").write_text(REPORT)
    monkeypatch.chdir(tmp_path)
    preloaded = await started()
    try:
        status, out = await run_forked(preloaded, [sys.executable, "-u", "-m", "pkg.tool", "x"])
    finally:
        preloaded.close()
    assert status == 0, out
    seen = json.loads(out)
    assert (seen["name"], seen["argv"], seen["path0"]) == (
        "__main__",
        [str(package / "tool.py"), "x"],
        str(tmp_path),
    )


AFTER_MAIN = """\
import atexit, pickle, sys, threading, time
class Point:
    pass
def seen(when):
    point = type(pickle.loads(pickle.dumps(Point()))).__name__  # found in __main__ by name
    main = sys.modules["__main__"].__dict__.get("Point") is Point
    print(when, sys.argv[0].endswith(".py"), point, main, flush=True)
def later():
    time.sleep(0.2)
    seen("thread")
threading.Thread(target=later).start()  # runs on after the module's code has ended
atexit.register(seen, "atexit")
print(__name__, __spec__.name, __package__, __file__ == sys.argv[0], flush=True)
seen("main")
"""


async def test_python_m_semantics_hold_after_the_module_ends_and_for_what_cannot_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``__main__`` and ``sys.argv[0]`` stay the module's for its threads and its ``atexit``
    callbacks (runpy.run_module would put them back as it returned), a package runs its
    ``__main__``, and a module that cannot be run is said in python's words."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "tool.py").write_text(AFTER_MAIN)
    (package / "__main__.py").write_text(AFTER_MAIN)
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "__init__.py").write_text("")
    monkeypatch.chdir(tmp_path)
    env = {"PATH": os.environ.get("PATH", "")}
    modules = ["pkg.tool", "pkg", "no_such_module", "bare", "no_such_package.tool"]
    fresh = {}
    for module in modules:
        done = subprocess.run(
            [sys.executable, "-u", "-m", module],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        fresh[module] = (done.returncode, done.stdout + done.stderr)
    preloaded = await started()
    try:
        forked = {
            module: await run_forked(preloaded, [sys.executable, "-u", "-m", module], env)
            for module in modules
        }
    finally:
        preloaded.close()
    assert forked == fresh
    assert fresh["pkg.tool"][1] == (
        "__main__ pkg.tool pkg True\nmain True Point True\nthread True Point True\n"
        "atexit True Point True\n"
    )
    assert fresh["bare"][0] == 1 and "cannot be directly executed" in fresh["bare"][1]


async def test_workers_die_with_the_zygote_however_it_dies(tmp_path: Path) -> None:
    (tmp_path / "sleeps.py").write_text("import time\ntime.sleep(600)\n")
    preloaded = await started()
    forked = await preloaded.spawn(
        [sys.executable, "-u", str(tmp_path / "sleeps.py")], dict(os.environ)
    )
    ended = os.pidfd_open(forked.pid)  # readable once the process has ended
    try:
        os.kill(preloaded._process.pid, signal.SIGKILL)  # the zygote dies however it dies
        status = await asyncio.wait_for(forked.wait(), 60)
        preloaded.close()
        gone, _, _ = select.select([ended], [], [], 60)
    finally:
        os.close(ended)
    assert status == -signal.SIGKILL  # what the launcher is told
    assert gone  # and so it is: its death signal killed it
    # its output ended with it: read to the end, its pipe is closed now rather than left open
    # for the garbage collector to find in some later test
    assert await asyncio.wait_for(forked.stdout.read(), 60) == b""


ASKS = """\
import json, os, sys
from epochal.zygote import channel_from, popen
channel = channel_from()
r, w = os.pipe()
child = popen(channel, sys.argv[1], ["from-worker", str(w)], env={"X": "1"}, stdin=True,
              stdout=True, pass_fds=(w,))
os.close(w)
line = child.stdout.readline().decode()
child.stdin.close()
status = child.wait(60)
print(json.dumps({"line": line, "status": status, "passed": os.read(r, 100).decode()}))
"""

ASKED = """\
import os, sys
print(os.environ.get("X"), sys.argv[1], flush=True)
os.write(int(sys.argv[2]), b"through the descriptor passed")
sys.stdin.read()  # until the worker closes it
sys.exit(5)
"""


async def test_a_worker_has_the_zygote_fork_a_process_of_its_own(tmp_path: Path) -> None:
    """As rank 0 does for its data-plane store server: pipes, a descriptor passed, its status."""
    (tmp_path / "asks.py").write_text(ASKS)
    (tmp_path / "asked.py").write_text(ASKED)
    preloaded = await started(("json",))
    try:
        status, out = await run_forked(
            preloaded,
            [sys.executable, "-u", str(tmp_path / "asks.py"), str(tmp_path / "asked.py")],
            dict(os.environ),
        )
    finally:
        preloaded.close()
    assert status == 0, out
    seen = json.loads(out.splitlines()[-1])
    assert seen["line"] == "1 from-worker\n"  # its environment and arguments, its output piped
    assert seen["passed"] == "through the descriptor passed"
    assert seen["status"] == 5  # once its input closed


def test_a_variable_without_its_channel_is_no_channel() -> None:
    """A process the worker starts inherits ``EPOCHAL_ZYGOTE`` but not the channel: the
    descriptor it names (if any) is checked to be a socket to that very process."""
    r, w = os.pipe()
    try:
        assert channel_from({CHANNEL_ENV: f"{r}:{os.getppid()}"}) is None
        assert channel_from({CHANNEL_ENV: f"999:{os.getpid()}"}) is None
        assert channel_from({CHANNEL_ENV: "junk"}) is None
        assert channel_from({}) is None
    finally:
        os.close(r)
        os.close(w)


async def test_a_zygote_that_cannot_import_its_modules_says_so(capfd: Any) -> None:
    preloaded = Preloaded.start(("no_such_module_here",), dict(os.environ))
    try:
        assert not await preloaded.ready()
        with pytest.raises(Exception, match="ended"):
            await preloaded.spawn([sys.executable, "-u", "x.py"], {})
    finally:
        preloaded.close()
    err = capfd.readouterr().err
    assert err == (  # one line, no traceback
        "epochal: cannot import 'no_such_module_here' once for every worker: "
        "ModuleNotFoundError: No module named 'no_such_module_here' (EPOCHAL_PRELOAD names what "
        "is imported; none imports nothing)\n"
    )


def test_preload_modules_come_from_the_variable() -> None:
    assert preload_modules({}) == DEFAULT_PRELOAD
    assert preload_modules({"EPOCHAL_PRELOAD": "none"}) == ()
    assert preload_modules({"EPOCHAL_PRELOAD": ""}) == ()
    assert preload_modules({"EPOCHAL_PRELOAD": "torch, numpy"}) == ("torch", "numpy")
    with pytest.raises(ConfigError, match=r"EPOCHAL_PRELOAD='torch;numpy'.*module name"):
        preload_modules({"EPOCHAL_PRELOAD": "torch;numpy"})


def test_only_a_python_script_or_module_command_is_forked() -> None:
    python = sys.executable
    assert parse_command([python, "-u", "t.py", "-m", "x"]) == ("t.py", None, ["-m", "x"])
    assert parse_command([python, "-u", "-m", "pkg.mod", "a"]) == (None, "pkg.mod", ["a"])
    with pytest.raises(ValueError):
        parse_command([python, "-X", "dev", "t.py"])


async def test_a_launch_starts_its_zygote_with_its_first_workers_and_falls_back_once() -> None:
    command = [sys.executable, "-u", "train.py"]
    unused = Preload(("json",), command, dict(os.environ))
    assert unused._zygote is None  # a launch that stops before any worker imports nothing
    unused.close()

    said: list[str] = []
    broken = Preload(("no_such_module_here",), command, dict(os.environ))
    try:
        assert await broken.get(lambda: said.append("failed")) is None
        assert await broken.get(lambda: said.append("failed")) is None  # said once, not retried
    finally:
        broken.close()
    assert said == ["failed"]

    off = Preload((), command, dict(os.environ))  # EPOCHAL_PRELOAD=none
    assert await off.get(lambda: said.append("off")) is None
    odd = Preload(("json",), [sys.executable, "-X", "dev", "train.py"], dict(os.environ))
    assert await odd.get(lambda: said.append("odd")) is None
    assert said == ["failed"]

    working = Preload(("json",), command, dict(os.environ))
    try:
        first = await working.get(lambda: said.append("working"))
        assert first is not None and await working.get(lambda: None) is first  # kept
    finally:
        working.close()


SLEEPS = "import sys, time\nprint('up', flush=True)\ntime.sleep(float(sys.argv[1]))\n"


async def test_a_shared_zygote_forks_for_every_launch_and_kills_what_a_closed_one_asked_for(
    tmp_path: Path,
) -> None:
    """``epochal preload SOCKET``: one process imports once; each launch that connects has its
    workers forked there, and a launch's workers end when it closes (or dies), not the others."""
    (tmp_path / "sleeps.py").write_text(SLEEPS)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    path = str(tmp_path / "preload.sock")
    server = serve(path, ("json",), env)
    try:
        assert os.stat(path).st_mode & 0o777 == 0o600  # this user's alone
        first = await Preloaded.connect(path, ("json",), env)
        assert cmdline(server.pid).startswith(f"epochal preload {path}: importing json".encode())
        second = await Preloaded.connect(path, ("json",), env)
        command = [sys.executable, "-u", str(tmp_path / "sleeps.py")]
        kept = await first.spawn([*command, "600"], env)
        dropped = await second.spawn([*command, "600"], env)
        done = await second.spawn([*command, "0"], env)
        for forked in (kept, dropped, done):
            assert await forked.stdout.readline() == b"up\n"
        assert await asyncio.wait_for(done.wait(), 60) == 0  # its status, through the socket
        ended = os.pidfd_open(dropped.pid)
        try:
            second.close()  # the launch ends (or dies): what it asked for is killed
            assert select.select([ended], [], [], 60)[0]
        finally:
            os.close(ended)
        assert kept.returncode is None
        os.kill(kept.pid, 0)  # the other launch's worker lives on
        first.close()
        for forked in (kept, dropped, done):
            assert await asyncio.wait_for(forked.stdout.read(), 60) == b""  # ended, all three
    finally:
        server.kill()
        server.wait()


async def test_a_shared_zygote_that_does_not_fit_is_said_and_the_launch_starts_its_own(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    path = str(tmp_path / "preload.sock")
    server = serve(path, ("json",), env)
    said: list[str] = []
    command = [sys.executable, "-u", "train.py"]
    try:
        other = {**env, PRELOAD_SOCKET_ENV: path, "OMP_NUM_THREADS": "4"}
        own = Preload(("json",), command, other)
        try:
            assert await own.get(lambda: said.append("failed"), said.append) is not None
            assert own._zygote is not None and own._zygote._process is not None  # its own
        finally:
            own.close()
        missing = Preload(("json", "csv"), command, {**env, PRELOAD_SOCKET_ENV: path})
        try:
            assert await missing.get(lambda: said.append("failed"), said.append) is not None
        finally:
            missing.close()
        shared = Preload(("json",), command, {**env, PRELOAD_SOCKET_ENV: path})
        try:
            got = await shared.get(lambda: said.append("failed"), said.append)
            assert got is not None and got._process is None  # the shared one
        finally:
            shared.close()
    finally:
        server.kill()
        server.wait()
    assert said == [
        f"{PRELOAD_SOCKET_ENV}={path}: it imported them with other values of OMP_NUM_THREADS "
        "('1', not '4'); this launch imports json in a process of its own",
        f"{PRELOAD_SOCKET_ENV}={path}: it has not imported csv; this launch imports json, csv in "
        "a process of its own",
    ]
    nowhere = Preload(("json",), command, {**env, PRELOAD_SOCKET_ENV: path})
    try:
        assert await nowhere.get(lambda: said.append("failed"), said.append) is not None
    finally:
        nowhere.close()
    assert said[-1] == (
        f"{PRELOAD_SOCKET_ENV}={path}: Connection refused; this launch imports json in a "
        "process of its own"
    )


LISTENS = """\
import os, socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.bind(sys.argv[1]); os.chmod(sys.argv[1], 0o777); s.listen()
print("listening", flush=True)
conn, _ = s.accept()
hello = '{"ready": true, "executable": "%s", "modules": ["json"], "env": {}}' % sys.argv[2]
conn.send(hello.encode())
time.sleep(30)
"""

CONNECTS = """\
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1]); s.settimeout(30)
print(repr(s.recv(65536)))
"""


@needs_root
def test_another_users_preloaded_process_is_never_used_nor_does_it_serve_another_user(
    tmp_path: Path,
) -> None:
    """A neighbour who listens where a launch looks for its preloaded process would run the
    launch's workers as themselves: the launch checks the peer is its own user. And a shared
    zygote whose socket was opened up still serves no one else."""
    with shared_scratch() as shared:
        planted = str(shared / "preload.sock")
        neighbour = subprocess.Popen(
            [
                *AS_OTHER_USER,
                "/usr/bin/python3",
                "-c",
                LISTENS,
                planted,
                sys.executable,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert neighbour.stdout is not None
            assert neighbour.stdout.readline() == "listening\n"
            with pytest.raises(OSError, match=f"served by user {OTHER_UID}, not by this user"):
                zygote.connect(planted, 30)
        finally:
            neighbour.kill()
            neighbour.communicate()

        path = str(shared / "ours.sock")
        server = serve(path, ("json",), dict(os.environ))
        try:
            channel, _ = zygote.connect(path, 60)  # ready: imported and serving
            channel.close()
            os.chmod(path, 0o777)
            tried = as_other_user(["/usr/bin/python3", "-c", CONNECTS, path])
            assert tried.stdout == "b''\n", tried  # closed at once, not even a hello
        finally:
            server.kill()
            server.wait()
