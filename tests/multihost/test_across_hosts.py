"""A coordinator and two workers on three hosts (network namespaces), CURVE on, no network hints.

Every host resolves its hostname to a loopback address, as in many containers; the workers are
started exactly as the guide's "Workers on other machines" (docs/hosts.md) says, with nothing but
the coordinator's address and the CURVE key files. Bounds derive from the configured timeouts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import epochal
from epochal.protocol import Liveness
from epochal.worker.control.backstop import ABORT_EXIT_CODE
from tests.integration.conftest import wait_for_record
from tests.multihost import netns
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "examples" / "digits.py"
RESUMABLE = REPO / "tests" / "integration" / "scripts" / "resumable.py"
PORT = 29400  # each test network is private, so a fixed port is free and a restart can rebind it

HEARTBEAT_TIMEOUT = 5.0
"""The coordinator's --heartbeat-timeout in these tests."""

_JOIN = epochal.JoinOptions()  # the worker's defaults
WORKER_HEARTBEAT_TIMEOUT = HEARTBEAT_TIMEOUT  # every worker takes the run's
ABORT_GRACE = _JOIN.abort_grace
HEARTBEAT_INTERVAL = Liveness().interval  # the run's default, which these tests keep
MARGIN = 3.0
DELAY_MS, LOSS_PERCENT = 50.0, 1.0  # on every link in test_delay_and_loss_on_every_link
RUN_DEADLINE = 300.0  # a whole short training run on a loaded machine: a hang, not a bound

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any epochal, gloo or NCCL setting: no hints."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("EPOCHAL_", "GLOO_", "NCCL_", "MASTER_"))
    }
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "EPOCHAL_PROGRESS": "0"})
    env.update(extra)
    return env


class Cluster:
    """Keys, a coordinator on host 0 and a worker on each other host, each logging to a file."""

    def __init__(self, net: netns.Network, tmp: Path, workers: int = 2) -> None:
        self.net = net
        self.tmp = tmp
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.workers = workers
        # one worker per host after the coordinator's; a one-host network holds them all
        self.places = [(i + 1) % len(net) if len(net) > 1 else 0 for i in range(workers)]
        self.keys = tmp / "keys"
        keygen = [sys.executable, "-m", "epochal", "keys", "generate"]
        subprocess.run(
            [*keygen, "--workers", str(workers), str(self.keys)],
            check=True,
            capture_output=True,
            env=clean_env(),
        )
        self.endpoint = f"tcp://{net[0].address}:{PORT}"
        self.logs: list[Path] = []

    def _start(self, host: netns.Host, argv: list[str], env: dict[str, str], name: str):
        log = self.tmp / f"{name}.log"
        self.logs.append(log)
        sink = log.open("a")
        proc = host.popen(argv, env=env, stdout=sink, stderr=subprocess.STDOUT, cwd=self.tmp)
        sink.close()
        proc.log = log  # type: ignore[attr-defined]
        return proc

    def coordinator(
        self, *args: str, name: str = "coordinator", **extra: str
    ) -> subprocess.Popen[bytes]:
        argv = ["python", "-m", "epochal", "coordinator", "--bind", self.endpoint]
        argv += ["--world-size", str(self.workers)]
        argv += ["--curve-key", str(self.keys / "coordinator.key_secret")]
        argv += ["--curve-allowed", str(self.keys / "allowed")]
        argv += ["--heartbeat-timeout", f"{HEARTBEAT_TIMEOUT:g}", *args]
        return self._start(self.net[0], argv, clean_env(**extra), name)

    def worker_env(self, index: int, **extra: str) -> dict[str, str]:
        return clean_env(
            EPOCHAL_COORDINATOR=self.endpoint,
            EPOCHAL_CURVE_KEY=str(self.keys / "workers" / f"worker-{index}.key_secret"),
            EPOCHAL_CURVE_SERVER_KEY=str(self.keys / "coordinator.key"),
            EPOCHAL_RANK=str(index),
            **extra,
        )

    def worker(self, index: int, argv: list[str], **extra: str) -> subprocess.Popen[bytes]:
        host = self.net[self.places[index]]
        return self._start(host, argv, self.worker_env(index, **extra), f"worker{index}")

    def dump(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text()}" for log in self.logs if log.exists())

    def wait(self, proc: subprocess.Popen[bytes], deadline: float = RUN_DEADLINE) -> str:
        try:
            proc.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{proc.args} ran past {deadline} s\n{self.dump()}")
        return proc.log.read_text()  # type: ignore[attr-defined]

    def none_left(self, wait: float = 5.0) -> None:
        wait_until(
            lambda: not self.net.leftover(),
            wait,
            lambda: f"processes left on the hosts: {self.net.leftover()}\n{self.dump()}",
            0.1,
        )


def journal_has(run_dir: Path, kind: str) -> None:
    """Until the run's journal holds a ``kind`` record, within the run's deadline."""
    wait_for_record(run_dir, kind, RUN_DEADLINE)


def run_to_end(cluster: Cluster, work: list[str], *policy: str) -> tuple[str, list[str]]:
    """Start the coordinator and every worker, wait for all; the logs (coordinator, workers)."""
    coordinator = cluster.coordinator(*policy, "--run-dir", str(cluster.tmp / "run"))
    workers = [cluster.worker(i, work) for i in range(cluster.workers)]
    outputs = [cluster.wait(w) for w in workers]
    log = cluster.wait(coordinator)
    assert coordinator.returncode == 0, cluster.dump()
    assert all(w.returncode == 0 for w in workers), cluster.dump()
    return log, outputs


def single_host(make_hosts, tmp: Path, work: list[str], *policy: str) -> list[str]:
    """The same invocation with the coordinator and both workers on one host: the reference."""
    cluster = Cluster(make_hosts(1), tmp / "one-host")
    return run_to_end(cluster, work, *policy)[1]


def result_line(output: str) -> str:
    found = re.findall(r"best epoch \d+ of \d+: .*test accuracy [0-9.]+", output)
    assert found, output
    return found[-1]


def test_digits_across_hosts_matches_one_host(make_hosts, tmp_path):
    net = make_hosts(3)
    cluster = Cluster(net, tmp_path)
    log, outputs = run_to_end(cluster, ["python", str(DIGITS)], "--epochs", "3")
    # the data plane is on each host's own network, never on the loopback its hostname maps to
    for rank in (0, 1):
        assert f"rank {rank}: " in log and f"data plane at {net[rank + 1].address}" in log, log
    expected = single_host(make_hosts, tmp_path, ["python", str(DIGITS)], "--epochs", "3")
    assert result_line(outputs[0]) == result_line(expected[0])
    cluster.none_left()


def test_a_loopback_data_plane_with_a_remote_coordinator_is_refused(make_hosts, tmp_path):
    net = make_hosts(2)
    cluster = Cluster(net, tmp_path)
    worker = cluster.worker(0, ["python", str(DIGITS)], EPOCHAL_HOST="127.0.0.1")
    output = cluster.wait(worker, deadline=120)
    assert worker.returncode != 0
    assert "loopback address 127.0.0.1" in output and "EPOCHAL_IFNAME" in output, output
    assert output.count("the data plane would use") == 1, output
    cluster.none_left()


def test_a_cut_link_aborts_and_the_cut_off_worker_exits(make_hosts, tmp_path):
    net = make_hosts(3)
    cluster = Cluster(net, tmp_path)
    run_dir = tmp_path / "run"
    coordinator = cluster.coordinator("--epochs", "200", "--run-dir", str(run_dir))
    # slow steps: the cut finds the workers inside an epoch, where gloo collectives run
    work = ["python", str(RESUMABLE), "--out", str(tmp_path / "out"), "--delay", "0.05"]
    # the re-attach window no longer than abort_grace: a worker that happens to be between
    # epochs when its link goes is bounded the same way as one blocked in a collective
    extra = {"EPOCHAL_REATTACH_TIMEOUT": f"{ABORT_GRACE:g}"}
    workers = [cluster.worker(i, work, **extra) for i in range(2)]
    journal_has(run_dir, "epoch")
    time.sleep(0.5)  # well inside the next epoch
    net[2].link(up=False)
    cut = time.monotonic()

    # the abort is timed when the coordinator says it; its exit after that (writing the result,
    # its interpreter's teardown) takes what the machine's load makes it take
    said = "sent nothing for"
    while said not in coordinator.log.read_text():  # type: ignore[attr-defined]
        assert coordinator.poll() is None, cluster.dump()
        assert time.monotonic() - cut < HEARTBEAT_TIMEOUT + MARGIN, cluster.dump()
        time.sleep(0.05)
    log = cluster.wait(coordinator, deadline=30)
    assert coordinator.returncode == 1, log
    assert re.search(rf"rank 1 \(worker .*at {re.escape(net[2].address)}", log), log

    # blocked in a collective, it waits the re-attach window too (a peer may bring the decision
    # it missed from a restarted coordinator), then ends itself
    bound = WORKER_HEARTBEAT_TIMEOUT + 2 * ABORT_GRACE + HEARTBEAT_INTERVAL + MARGIN
    cut_off = cluster.wait(workers[1], deadline=bound + 30)
    gone = time.monotonic() - cut
    assert gone < bound, (gone, cut_off)
    if "waiting up to" in cut_off:  # the cut came between epochs: it tried to re-attach
        assert workers[1].returncode != 0, cut_off
    else:  # blocked in a collective: it ended itself
        assert workers[1].returncode == ABORT_EXIT_CODE, cut_off
        assert "rank 1: the coordinator at" in cut_off and "cannot re-attach" in cut_off, cut_off
    cluster.wait(workers[0], deadline=30)
    assert workers[0].returncode != 0
    cluster.none_left()


def test_delay_and_loss_on_every_link(make_hosts, tmp_path):
    """50 ms and 1% on every link (netem, or the userspace switch where the kernel has none).

    A round trip takes 100 ms or more, so every control message, the store, gloo's connect and
    each allreduce are slower by that much; the heartbeat timeout (5 s) is still 50 round trips,
    so the run must end as without impairment, only later. RUN_DEADLINE bounds a hang.
    """
    net = make_hosts(3)
    how = net.impair(DELAY_MS, LOSS_PERCENT)
    cluster = Cluster(net, tmp_path)
    _, outputs = run_to_end(cluster, ["python", str(DIGITS)], "--epochs", "2")
    assert "test accuracy" in outputs[0]
    if how == "userspace":  # the frames did go through it, and some were lost on the way
        counts = dict(kv.split("=") for kv in net.stop_switch().split())
        assert int(counts["forwarded"]) > 0 and int(counts["lost"]) > 0, counts
    cluster.none_left()


POLICY = ["--epochs", "4", "--lr-schedule", "step:every=2,gamma=0.5"]


def models(out: Path) -> list[dict[str, object]]:
    import torch

    return [torch.load(out / f"rank{rank}.pt")["model"] for rank in (0, 1)]


def assert_bit_identical(ref: Path, out: Path) -> None:
    import torch

    for a, b in zip(models(ref), models(out), strict=True):
        for name in a:
            assert torch.equal(a[name], b[name]), name  # type: ignore[arg-type]


def test_a_killed_worker_is_restarted_and_the_run_ends_bit_identical(make_hosts, tmp_path):
    net = make_hosts(3)
    cluster = Cluster(net, tmp_path)
    run_dir = tmp_path / "run"
    coordinator = cluster.coordinator(*POLICY, "--run-dir", str(run_dir), "--max-restarts", "1")
    supervisor = ["python", "-m", "epochal", "worker", "--connect", cluster.endpoint]
    supervisor += ["--max-restarts", "1", "--"]
    work = ["python", str(RESUMABLE), "--out", str(tmp_path / "out"), "--delay", "0.02"]
    supervisors = [
        cluster.worker(
            i,
            [*supervisor, *work],
        )
        for i in range(2)
    ]
    journal_has(run_dir, "checkpoint")
    victim = next(
        pid
        for pid in net[2].pids()
        # a forked process's command line is one string of words (setproctitle), an exec'd
        # one's NUL-separated: the supervisor is "epochal worker" either way
        if b"resumable.py" in (cmd := Path(f"/proc/{pid}/cmdline").read_bytes())
        and b"epochal worker" not in cmd.replace(b"\0", b" ")
    )
    os.kill(victim, signal.SIGKILL)
    for sup in supervisors:
        cluster.wait(sup)
        assert sup.returncode == 0, cluster.dump()
    log = cluster.wait(coordinator)
    assert coordinator.returncode == 0, cluster.dump()
    assert "restart 1 of 1" in log and "resuming" in log, log
    reference = ["python", str(RESUMABLE), "--out", str(tmp_path / "ref-out")]
    single_host(make_hosts, tmp_path, reference, *POLICY)
    assert_bit_identical(tmp_path / "ref-out", tmp_path / "out")
    cluster.none_left()


def test_a_restarted_coordinator_takes_the_workers_back_across_hosts(make_hosts, tmp_path):
    """Killed between its two sends of a decision (rank 0 has it, rank 1 waits for it): the
    restarted coordinator answers rank 1 from its journal, and no epoch is redone."""
    net = make_hosts(3)
    cluster = Cluster(net, tmp_path)
    run_dir = tmp_path / "run"
    cut = "kill@decision:epoch=1"
    coordinator = cluster.coordinator(
        *POLICY, "--run-dir", str(run_dir), EPOCHAL_COORDINATOR_FAULT=cut
    )
    work = ["python", str(RESUMABLE), "--out", str(tmp_path / "out"), "--delay", "0.02"]
    workers = [cluster.worker(i, work) for i in range(2)]
    coordinator.wait(timeout=RUN_DEADLINE)
    assert coordinator.returncode == -signal.SIGKILL, cluster.dump()
    again = cluster.coordinator(*POLICY, "--run-dir", str(run_dir), name="coordinator-again")
    outputs = []
    for w in workers:
        output = cluster.wait(w)
        assert w.returncode == 0, cluster.dump()
        assert "the restarted coordinator carries on from its journal" in output, output
        outputs.append(output)
    assert "its report of epoch 2" in outputs[0], outputs[0]  # it had trained the next epoch
    assert "sent again: its report of epoch 1\n" in outputs[1], outputs[1]
    log = cluster.wait(again)
    assert again.returncode == 0, cluster.dump()
    assert "the run carries on in epoch 2" in log, log
    records = [json.loads(line) for line in (run_dir / "epochs.jsonl").read_text().splitlines()]
    decided = [r["epoch"] for r in records if r["kind"] == "epoch"]
    assert decided == list(range(int(POLICY[1]))), decided  # each epoch once: none redone
    reference = ["python", str(RESUMABLE), "--out", str(tmp_path / "ref-out")]
    single_host(make_hosts, tmp_path, reference, *POLICY)
    assert_bit_identical(tmp_path / "ref-out", tmp_path / "out")
    cluster.none_left()
