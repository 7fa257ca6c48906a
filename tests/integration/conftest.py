"""Process hygiene for the multi-process tests: deadlines, output on failure, nothing left behind.

Every process a test starts through the ``spawn`` fixture carries a unique marker in its
environment; at teardown every process still carrying it (workers' children included) is killed
and the test fails, so a leak is a red test rather than a stuck CI.

The processes are forked from the session's preloaded process where they can be
(:mod:`tests.forked`); a test marked :data:`BOTH_STARTS` also runs with each started fresh, as a
deployment starts them (:mod:`tests.fresh`), and so does every test under ``EPOCHAL_TEST_FRESH=1``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from epochal.environment import PRELOAD_SOCKET_ENV
from tests.forked import ForkedProcess, forkable
from tests.fresh import (
    FORKED,
    FRESH,
    FRESH_ENV,
    STARTS_ENV,
    environment,
    failures,
    read_starts,
)
from tests.fresh import whole_suite as fresh_suite
from tests.waiting import wait_until

MARK = "EPOCHAL_TEST_MARK"
LISTENING = "epochal coordinator listening on "
"""The first line ``epochal coordinator`` prints on stdout, before the address it bound."""
SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).resolve().parents[2]


def marked_pids(mark: str) -> list[int]:
    """Live processes whose environment carries ``MARK=mark``."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                status = (entry / "stat").read_text().split(")")[-1].split()[0]
                if status != "Z":
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def cmdline(pid: int) -> bytes:
    """Process ``pid``'s command line as /proc has it (b"" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone meanwhile
        return b""


class Spawner:
    """Starts a test's processes (``fresh``: each a new interpreter, noted in ``starts``;
    default: fresh under ``EPOCHAL_TEST_FRESH``, else forked where it can be) and ends them."""

    def __init__(self, mark: str, tmp: Path, *, fresh: bool | None = None) -> None:
        self.mark = mark
        self.tmp = tmp
        self.procs: list[subprocess.Popen[str]] = []
        self.fresh = fresh_suite() if fresh is None else fresh
        self.starts = tmp.parent / f"{tmp.name}-starts-{mark}.jsonl"
        self.started_fresh = 0  # not those of a test of preloading (env)

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a process started with ``extra``: a fresh start's unless ``extra``
        names a preloaded process itself (a test of preloading)."""
        env = dict(os.environ)
        for key in [k for k in env if k.startswith("EPOCHAL_") and k != PRELOAD_SOCKET_ENV]:
            del env[key]
        env.update({MARK: self.mark, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
        env.update(extra)
        if self.fresh and PRELOAD_SOCKET_ENV not in extra:
            return environment(env, self.starts)
        return env

    def not_fresh(self) -> list[str]:
        """Why a process this fresh spawner started may have been forked (empty: none was)."""
        return failures(read_starts(self.starts), self.started_fresh)

    def start(self, *args: str, **env: str) -> subprocess.Popen[str]:
        """``python ARGS``, unbuffered, in a session of its own, its output (and errors) on a text
        pipe: forked from the session's preloaded process where it can be (:mod:`tests.forked`),
        else started afresh."""
        full = self.env(**env)
        self.started_fresh += STARTS_ENV in full
        proc: Any
        if full.get(PRELOAD_SOCKET_ENV) and forkable(args):
            proc = ForkedProcess(args, env=full, cwd=self.tmp)
        else:
            proc = subprocess.Popen(
                [sys.executable, *args],
                env=full,
                cwd=self.tmp,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc  # type: ignore[no-any-return]

    def epochal(self, *args: str, **env: str) -> subprocess.Popen[str]:
        return self.start("-m", "epochal", *args, **env)

    def script(self, name: str, *args: str, **env: str) -> subprocess.Popen[str]:
        return self.start(str(SCRIPTS / name), *args, **env)

    @staticmethod
    def finish(proc: subprocess.Popen[str], deadline: float) -> tuple[int, str]:
        """Wait for ``proc`` for at most ``deadline`` seconds; fail with its output if it hangs."""
        try:
            out, _ = proc.communicate(timeout=deadline)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            pytest.fail(f"process {proc.args} hung past {deadline} s; its output:\n{out}")
        return proc.returncode, out

    def assert_none_left(self, wait: float = 3.0) -> None:
        """Fail if any process this test started (or a child of it) still lives after ``wait`` s."""
        wait_until(
            lambda: not marked_pids(self.mark),
            wait,
            lambda: f"processes left behind: {marked_pids(self.mark)}",
        )

    def cleanup(self) -> list[int]:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                proc.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError):
                pass
        leftover: list[int] = []
        for _ in range(20):  # processes just killed take a moment to vanish
            leftover = marked_pids(self.mark)
            if not leftover:
                break
            time.sleep(0.1)
        for pid in leftover:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return leftover


@pytest.fixture
def spawn(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Spawner]:
    """A :class:`Spawner` for the test: forked, or fresh where :data:`BOTH_STARTS` says so or
    ``EPOCHAL_TEST_FRESH`` is set; a fresh one fails the test if a process may have been forked."""
    start = getattr(request, "param", FRESH if fresh_suite() else FORKED)
    if start == FORKED and fresh_suite():
        pytest.skip(f"{FRESH_ENV} is set: the suite starts nothing forked")
    spawner = Spawner(uuid.uuid4().hex, tmp_path, fresh=start == FRESH)
    yield spawner
    leftover = spawner.cleanup()
    assert not leftover, f"processes left behind after the test: {leftover}"
    if spawner.fresh:
        forked = spawner.not_fresh()
        assert not forked, "a fresh test's process may have been forked:\n" + "\n".join(forked)


BOTH_STARTS = pytest.mark.parametrize("spawn", [FORKED, FRESH], indirect=True)
"""The test runs twice: its processes forked from the preloaded process, and started fresh, each
a new interpreter (``[forked]`` and ``[fresh]`` in its id). One test of each way of starting a
run carries it (``tests/test_fresh.py`` holds that), the cheapest that covers it: a fresh start
costs each process its imports of torch and epochal."""


class StandaloneRun:
    """``epochal coordinator`` as a service (run directory ``TMP/run``) and ``resumable.py``
    workers started apart from it, pointed at it by ``EPOCHAL_COORDINATOR`` alone: the
    multi-machine setup, on one machine.

    The coordinator's output (stdout and stderr) is read as it comes, so that a full pipe never
    stalls it, and each line's arrival is timed (:meth:`said`); :meth:`finish_coordinator` returns
    it.
    """

    def __init__(self, spawn: Spawner, world: int, *coordinator_args: str) -> None:
        self.spawn = spawn
        self.run_dir = spawn.tmp / "run"
        self.out = spawn.tmp / "out"
        self.coordinator = spawn.epochal(
            "coordinator",
            "--world-size",
            str(world),
            *coordinator_args,
            "--run-dir",
            str(self.run_dir),
        )
        assert self.coordinator.stdout is not None
        line = self.coordinator.stdout.readline()
        assert line.startswith(LISTENING), line
        self.endpoint = line[len(LISTENING) :].strip()
        self.world = world
        self.workers: list[subprocess.Popen[str]] = []
        self._log: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.coordinator.stdout is not None
        for line in self.coordinator.stdout:
            self._log.append((time.monotonic(), line))

    def start_workers(
        self,
        *script_args: str,
        delay: float = 0.03,
        connect: Mapping[int, str] | None = None,
        **env: str,
    ) -> list[subprocess.Popen[str]]:
        """One worker per rank, asking for that rank; ``connect`` gives some ranks another
        address than the coordinator's (a proxy in between)."""
        self.workers = [
            self.spawn.script(
                "resumable.py",
                "--out",
                str(self.out),
                "--delay",
                str(delay),
                *script_args,
                EPOCHAL_COORDINATOR=(connect or {}).get(rank, self.endpoint),
                EPOCHAL_RANK=str(rank),
                **env,
            )
            for rank in range(self.world)
        ]
        return self.workers

    def wait_for_first_epoch(self, deadline: float = 60.0) -> None:
        """Until the journal holds a first line: the run is under way."""
        wait_for_record(self.run_dir, deadline=deadline, alive=self.coordinator)

    def finish_coordinator(self, deadline: float) -> tuple[int, str]:
        """Wait for the coordinator at most ``deadline`` seconds; its status and its output."""
        try:
            code = self.coordinator.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            os.killpg(self.coordinator.pid, signal.SIGKILL)
            self._reader.join(timeout=10)
            pytest.fail(f"the coordinator hung past {deadline} s; its output:\n{self.output}")
        self._reader.join(timeout=10)
        return code, self.output

    @property
    def output(self) -> str:
        return "".join(line for _, line in self._log)

    def said(self, text: str) -> float | None:
        """When (``time.monotonic()``) the coordinator first printed a line holding ``text``."""
        return next((when for when, line in list(self._log) if text in line), None)


def standalone_run(
    spawn: Spawner,
    *coordinator_args: str,
    world: int = 2,
    worker_args: tuple[str, ...] = (),
    delay: float = 0.03,
    **worker_env: str,
) -> StandaloneRun:
    """A :class:`StandaloneRun` with its workers started."""
    run = StandaloneRun(spawn, world, *coordinator_args)
    run.start_workers(*worker_args, delay=delay, **worker_env)
    return run


# ----------------------------------------------------------------------------- resumable runs

RESUMABLE_EPOCHS = 5
RESUMABLE_DEADLINE = 120.0
RESUMABLE_POLICY = [
    "--epochs",
    str(RESUMABLE_EPOCHS),
    "--lr-schedule",
    "step:every=2,gamma=0.5",
    "--smoothing",
    "0.6",
]
"""The settings of the runs of ``resumable.py`` whose results the resume tests compare."""


def resumable_run(
    spawn: Spawner,
    out: Path,
    *options: str,
    delay: float = 0.0,
    script: tuple[str, ...] = (),
    **env: str,
) -> subprocess.Popen[str]:
    """``epochal run --nproc 2 POLICY OPTIONS resumable.py --out OUT --delay DELAY SCRIPT``
    (an option given twice: the later one counts, as ``--epochs``)."""
    return spawn.epochal(
        "run",
        "--nproc",
        "2",
        *RESUMABLE_POLICY,
        *options,
        str(SCRIPTS / "resumable.py"),
        "--out",
        str(out),
        "--delay",
        str(delay),
        *script,
        **env,
    )


def epoch_records(run_dir: Path) -> list[dict[str, Any]]:
    """The journal's complete lines."""
    path = run_dir / "epochs.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip().endswith("}")]


def wait_for_record(
    run_dir: Path,
    kind: str | None = None,
    deadline: float = 60.0,
    alive: subprocess.Popen[Any] | None = None,
) -> None:
    """Until the run's journal (``RUN_DIR/epochs.jsonl``) holds a record of ``kind`` (None: any
    line); fails past ``deadline`` seconds, or as soon as ``alive`` (the run's process) has ended,
    naming its exit status."""
    journal = run_dir / "epochs.jsonl"
    wanted, what = ("\n", "first") if kind is None else (f'"kind": "{kind}"', kind)
    end = time.monotonic() + deadline
    while not (journal.exists() and wanted in journal.read_text()):
        if alive is not None and alive.poll() is not None:
            pytest.fail(f"the run ended (status {alive.returncode}) before a {what} record")
        assert time.monotonic() < end, f"no {what} record in {journal} within {deadline} s"
        time.sleep(0.05)


def assert_same_result(a: Path, b: Path) -> None:
    """The two runs' results (``resumable.py --out``) are the same: curve and weights exactly."""
    import torch

    for rank in (0, 1):
        x, y = torch.load(a / f"rank{rank}.pt"), torch.load(b / f"rank{rank}.pt")
        assert x["best_epoch"] == y["best_epoch"]
        assert x["best"] == y["best"] == y["best_epoch"], "the best epoch's curve record"
        assert x["curve"] == y["curve"], "the whole learning curve, also after a resume"
        assert y["weights_note"] is None
        assert x["model"].keys() == y["model"].keys()
        for name in x["model"]:
            assert torch.equal(x["model"][name], y["model"][name]), name


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run's results, once for every test that compares with it."""
    tmp = tmp_path_factory.mktemp("reference")
    spawner = Spawner("ref-" + os.urandom(4).hex(), tmp)
    try:
        proc = resumable_run(spawner, tmp / "out", "--run-dir", str(tmp / "run"))
        code, output = spawner.finish(proc, RESUMABLE_DEADLINE)
        assert code == 0, output
    finally:
        spawner.cleanup()
    return tmp / "out"


class TcpRelay(threading.Thread):
    """A TCP relay on loopback to ``target_port``, a thread for each direction of each connection.
    :meth:`watch` may give a callable that sees every chunk of a direction on its way (a
    connection's own state); clearing ``flowing`` holds everything while keeping the connections
    open (a cut link). A connection ended on either side is shut on both."""

    def __init__(self, target_port: int) -> None:
        super().__init__(daemon=True)
        self.target = ("127.0.0.1", target_port)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.flowing = threading.Event()
        self.flowing.set()
        self.closing = threading.Event()
        self.sockets: list[socket.socket] = [self.server]

    def watch(self, upstream: bool) -> Callable[[bytes], None] | None:
        """What sees the chunks of one direction of a new connection (``upstream``: from the
        client); None: nothing."""
        return None

    def run(self) -> None:
        self.server.settimeout(0.2)
        while not self.closing.is_set():
            try:
                client, _ = self.server.accept()
            except TimeoutError:
                continue
            except OSError:  # closed by close()
                return
            upstream = socket.create_connection(self.target)
            self.sockets += [client, upstream]
            for a, b, up in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pump, args=(a, b, up), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket, upstream: bool) -> None:
        seen = self.watch(upstream)
        a.settimeout(0.2)
        while not self.closing.is_set():
            if not self.flowing.is_set():
                time.sleep(0.05)  # cut: hold everything, close nothing
                continue
            try:
                data = a.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            if seen is not None:
                seen(data)
            try:
                b.sendall(data)
            except OSError:
                break
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.closing.set()
        self.join(timeout=5)  # the accept loop notices within its 0.2 s timeout
        for s in self.sockets:
            s.close()
