"""A private two-node Slurm cluster on this machine, for running the batch script for real.

Everything it starts is its own: a munge daemon with its own key and socket, a ``slurm.conf`` in a
temporary directory (handed to every Slurm command through ``SLURM_CONF``), non-default ports, one
``slurmctld`` and two ``slurmd`` (nodes ``n1`` and ``n2``, both at 127.0.0.1 with a port each),
state and spool directories under the same temporary directory. No cgroups, no accounting
daemon: ``proctrack/linuxproc`` and ``task/none``. Every daemon is started in the foreground as a
child of the test and stopped by its pid, whatever happened in between.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue")

START_TIMEOUT = 60.0
"""Seconds for munge, the controller and both nodes to come up and report the nodes idle."""

KILL_WAIT = 5
"""Seconds between SIGTERM and SIGKILL when Slurm ends a job's processes (KillWait)."""

MIN_JOB_AGE = 600
"""Seconds the controller remembers a finished job, so ``scontrol show job`` still answers."""

NODES = ("n1", "n2")


def missing_programs() -> list[str]:
    """The Slurm and munge programs this machine lacks (install ``slurm-wlm`` and ``munge``)."""
    return [name for name in DAEMONS if shutil.which(name) is None]


def _free_ports(count: int) -> list[int]:
    """Ports the kernel hands out for port 0 now; the daemons bind them a moment later.

    Slurm's daemons take their ports from ``slurm.conf``, so they cannot bind port 0 themselves;
    the sockets are held open together so the ports are distinct.
    """
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass
class SlurmCluster:
    """A running private cluster: where its files are and how to talk to it."""

    root: Path
    conf: Path
    env: dict[str, str]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def run(self, *args: str, timeout: float = 30.0) -> str:
        """Run a Slurm client command against this cluster; its stdout, or a failure naming it."""
        done = subprocess.run(
            args, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}\n{self.logs()}"
            )
        return done.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict of its KEY=VALUE fields."""
        text = self.run("scontrol", "show", "job", "--oneliner", job_id)
        return dict(re.findall(r"(\w+(?::\w+)?)=(\S*)", text))

    def node_states(self) -> dict[str, str]:
        text = self.run("sinfo", "--noheader", "--Node", "--format=%N %T")
        return dict(line.split() for line in text.splitlines() if line.strip())

    def logs(self) -> str:
        """The tail of every daemon's log, for a failure message."""
        parts = []
        for log in sorted((self.root / "log").glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-25:]
            parts.append(f"--- {log.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def wait_job(
        self, job_id: str, states: set[str], timeout: float, poll: float = 0.5
    ) -> dict[str, str]:
        """Wait until the job's state is one of ``states``; its fields, or a failure with logs."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"job {job_id} still {info.get('JobState')} after {timeout:.0f} s, "
                    f"expected {sorted(states)}\n{info}\n{self.logs()}"
                )
            time.sleep(poll)


def _write_config(root: Path, munge_socket: Path) -> Path:
    ctld_port, n1_port, n2_port = _free_ports(3)
    for sub in ("state", "spool/n1", "spool/n2", "log", "run"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text(
        f"""\
ClusterName=epochaltest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
MinJobAge={MIN_JOB_AGE}
KillWait={KILL_WAIT}
SlurmdTimeout=60
InactiveLimit=0
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n1_port} CPUs=2 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n2_port} CPUs=2 State=UNKNOWN
PartitionName=test Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
"""
    )
    return conf


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=15)


@contextmanager
def slurm_cluster(env: dict[str, str]) -> Iterator[SlurmCluster]:
    """Start munge, slurmctld and slurmd n1, n2 in a new directory; stop them all on leaving.

    The directory is made directly under /tmp: munged insists that every directory above its
    socket be searchable by everyone, which pytest's private temporary directories are not.
    """
    root = Path(tempfile.mkdtemp(prefix="epochal-slurm-", dir="/tmp"))
    # munged wants its socket's directories searchable by all and writable only by their owner
    os.chmod(root, 0o755)
    munge_dir = root / "munge"
    munge_dir.mkdir(exist_ok=True)
    os.chmod(munge_dir, 0o755)
    munge_socket = munge_dir / "munge.socket"
    key = munge_dir / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    conf = _write_config(root, munge_socket)
    env = {**env, "SLURM_CONF": str(conf)}
    cluster = SlurmCluster(root=root, conf=conf, env=env)
    log = root / "log"

    def start(name: str, args: list[str]) -> None:
        with (log / f"{name}.stderr.log").open("wb") as err:  # the child keeps its own copy
            cluster.procs[name] = subprocess.Popen(
                args, env=env, stdout=subprocess.DEVNULL, stderr=err
            )

    try:
        start(
            "munged",
            [
                "munged",
                "--foreground",
                f"--socket={munge_socket}",
                f"--key-file={key}",
                f"--pid-file={munge_dir}/munged.pid",
                f"--log-file={log}/munged.log",
                f"--seed-file={munge_dir}/munged.seed",
            ],
        )
        _wait_for(lambda: munge_socket.exists(), "munged to create its socket", cluster)
        start("slurmctld", ["slurmctld", "-D", "-i"])
        for node in NODES:
            start(node, ["slurmd", "-D", "-N", node])

        def nodes_idle() -> bool:
            try:
                states = cluster.node_states()
            except RuntimeError:
                return False
            return all(states.get(node, "").rstrip("*") == "idle" for node in NODES)

        _wait_for(nodes_idle, "both nodes to report idle", cluster)
        yield cluster
    finally:
        # jobs first (cancelled while the controller can still reach the nodes), then the nodes,
        # the controller, munge last; whatever a job left is found by the marker in its env
        if "slurmctld" in cluster.procs and cluster.procs["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", "--user=root"], env=env, check=False, timeout=30)
        for name in (*reversed(NODES), "slurmctld", "munged"):
            if name in cluster.procs:
                _stop(cluster.procs[name])
        if all(p.poll() is not None for p in cluster.procs.values()):
            shutil.rmtree(root, ignore_errors=True)


def _wait_for(ready: object, what: str, cluster: SlurmCluster) -> None:
    assert callable(ready)
    deadline = time.monotonic() + START_TIMEOUT
    while not ready():
        dead = {name: p.returncode for name, p in cluster.procs.items() if p.poll() is not None}
        if dead:
            raise RuntimeError(f"waiting for {what}: {dead} exited\n{cluster.logs()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {START_TIMEOUT:.0f} s\n{cluster.logs()}")
        time.sleep(0.2)
