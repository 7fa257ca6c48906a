"""What a flood of strangers' frames costs a real run: its epochs' pace under each flood, against
its pace undisturbed in the same run, and how long the run takes to catch up once it ends.

    python bench/flood.py [--epochs 12] [--rate 0] [--shapes well-formed,dense,strings]

A real 2-worker ``epochal run`` on localhost trains short epochs (the suite's resumable script,
0.01 s a step). The bench measures ``--epochs`` epochs undisturbed, then, for each shape, floods
the coordinator from a helper process without the run's token while ``--epochs`` more epochs are
decided, and stops:

- ``well-formed``: the largest legal hello, its fingerprint listing every entry that fits;
- ``dense``: hellos whose trailing field (one this version does not know) is an empty list, an
  empty map or a small int per byte, to the frame's limit (``bench/codec.py``'s hostile frames);
- ``strings``: hellos whose strings are at their longest, in four-byte characters.

Each frame comes from a fresh identity (a socket per 8 frames), as fast as the helper can send
(``--rate 0``) or at ``--rate`` bytes a second. Per shape it prints the epochs' pace under the
flood as a ratio of the undisturbed pace, and ``catch-up``: the time from the flood's end to the
next epoch decided, as a multiple of the undisturbed time of an epoch (about 1: nothing was left
queued), and ``cores``: the CPU the run's coordinator process (its libzmq threads included) took
during the flood, beside its undisturbed figure. The strangers' share of the coordinator's time
(``STRANGER_SHARE``) is what holds these.

On a machine of few cores the flooder's own process takes CPU from the run as well, whatever the
coordinator does with its frames. So each shape is also sent, for as many epochs, to a bare
ROUTER in another process that reads every frame and drops it (``sink``: the run's pace then,
as a ratio of the undisturbed pace), and ``own`` is the ratio under the real flood over that one:
what the coordinator's handling of the flood costs the run, the machine's share divided out.
"""

from __future__ import annotations

import argparse
import errno
import json
import multiprocessing as mp
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from codec import hostile, largest_hello  # noqa: E402

from epochal.protocol import MAX_NAME_CHARS  # noqa: E402
from tests.integration.conftest import epoch_records  # noqa: E402


def shapes() -> dict[str, list[bytes]]:
    frames = hostile()
    longest = "\U0001f600" * MAX_NAME_CHARS
    strings = msgpack.unpackb(largest_hello())
    del strings["params"]
    strings.update(token=longest, worker_id=longest, host=longest, data_address=longest)
    return {
        "well-formed": [largest_hello()],
        "dense": [frames["nested empty lists"], frames["lists of lists"], frames["dense nil"]],
        "strings": [msgpack.packb(strings)],
    }


def flood(endpoint: str, frames: list[bytes], rate: float, stop: Any, total: Any) -> None:
    """Send ``frames`` in turn, 8 from each fresh identity, until ``stop`` (a threading or
    multiprocessing Event) is set, at ``rate`` bytes a second (0: as fast as it can); the bytes
    sent go to ``total.value``. tests/integration/test_hostile.py floods a run with it too."""
    _, most = resource.getrlimit(resource.RLIMIT_NOFILE)
    ctx = zmq.Context()
    ctx.setsockopt(zmq.MAX_SOCKETS, most)  # closed sockets count until libzmq has reaped them
    sent, start, n = 0, time.monotonic(), 0
    try:
        while not stop.is_set():
            try:
                sock = ctx.socket(zmq.DEALER)
            except zmq.ZMQError as exc:  # libzmq has not reaped the closed ones yet
                if exc.errno not in (errno.EMFILE, errno.ENFILE):
                    raise
                time.sleep(0.01)
                continue
            sock.setsockopt(zmq.IDENTITY, f"flood-{os.getpid()}-{n}".encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 64)
            sock.connect(endpoint)
            for k in range(8):
                frame = frames[(n + k) % len(frames)]
                try:
                    sock.send(frame, zmq.NOBLOCK)
                except zmq.Again:
                    break
                sent += len(frame)
                if rate > 0:
                    ahead = sent / rate - (time.monotonic() - start)
                    if ahead > 0:
                        time.sleep(ahead)
            sock.close(linger=0)
            n += 1
            total.value = sent
    finally:
        ctx.term()


def _every_descriptor() -> int:
    """Raise this process's open-files limit to its hard limit; that limit."""
    _, most = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (most, most))
    return most


def flooder(endpoint: str, frames: list[bytes], rate: float, stop: Any, total: Any) -> None:
    """:func:`flood` in a process of its own, with all the descriptors it may have (libzmq closes
    the sockets of the identities it is done with only as it can)."""
    _every_descriptor()
    flood(endpoint, frames, rate, stop, total)


def sink(ready: Any, stop: Any) -> None:
    """A bare ROUTER on a loopback port of its own that reads every frame and drops it; its
    endpoint goes to ``ready`` (a queue); it ends when ``stop`` is set."""
    ctx = zmq.Context()
    ctx.setsockopt(zmq.MAX_SOCKETS, _every_descriptor())
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:0")
    ready.put(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    while not stop.is_set():
        if sock.poll(100):
            while True:
                try:
                    sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
    sock.close(linger=0)
    ctx.term()


def cpu_seconds(pid: int) -> float:
    """User and system time of process ``pid`` so far, all its threads (libzmq's included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def decided_at(run_dir: Path) -> list[float]:
    """When each epoch decided so far was journaled (wall clock)."""
    return [r["time"] for r in epoch_records(run_dir) if r.get("kind") == "epoch"]


def wait_epochs(run_dir: Path, count: int, run: subprocess.Popen[bytes]) -> list[float]:
    while len(times := decided_at(run_dir)) < count:
        if run.poll() is not None:
            said = Path(run_dir.parent / "run.log").read_text()[-2000:]
            raise SystemExit(f"the run ended early (status {run.returncode}):\n{said}")
        time.sleep(0.02)
    return times


def flood_window(
    run_dir: Path,
    run: subprocess.Popen[bytes],
    endpoint: str,
    frames: list[bytes],
    args: argparse.Namespace,
    pid: int,
) -> tuple[float, float, float, float]:
    """Flood ``endpoint`` while the run decides ``args.epochs`` epochs: the run's pace meanwhile
    (epochs a second), the cores its coordinator (``pid``) took, when the flood ended and the
    MiB a second sent."""
    stop = mp.Event()
    sent = mp.Value("d", 0.0)
    helper = mp.Process(target=flooder, args=(endpoint, frames, args.rate, stop, sent))
    began, cpu = time.time(), cpu_seconds(pid)
    helper.start()
    done = len(decided_at(run_dir))
    times = wait_epochs(run_dir, done + args.epochs, run)
    pace = args.epochs / (times[-1] - began)
    cores = (cpu_seconds(pid) - cpu) / (time.time() - began)
    stop.set()
    ended = time.time()
    helper.join()
    return pace, cores, ended, sent.value / (ended - began) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=12, help="epochs in each window")
    parser.add_argument("--rate", type=float, default=0.0, help="bytes a second; 0: at once")
    parser.add_argument("--shapes", default="well-formed,dense,strings")
    args = parser.parse_args()
    chosen = {name: frames for name, frames in shapes().items() if name in args.shapes.split(",")}
    epochs = args.epochs * (3 * len(chosen) + 2) + 8 * len(chosen) + 8
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        script = ROOT / "tests" / "integration" / "scripts" / "resumable.py"
        command = [sys.executable, "-m", "epochal", "run", "--nproc", "2"]
        command += ["--epochs", str(epochs), "--run-dir", str(run_dir), str(script)]
        command += ["--out", f"{tmp}/out", "--delay", "0.01"]
        log = open(Path(tmp) / "run.log", "wb")  # noqa: SIM115 - read back if the run fails
        run = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            start = len(wait_epochs(run_dir, 3, run))
            described = json.loads((run_dir / "run.json").read_text())
            endpoint, pid = described["endpoint"], described["pid"]
            cpu, at = cpu_seconds(pid), time.time()
            times = wait_epochs(run_dir, start + args.epochs, run)
            per_epoch = (times[-1] - times[start - 1]) / args.epochs
            quiet = (cpu_seconds(pid) - cpu) / (time.time() - at)
            print(f"undisturbed: {1 / per_epoch:.2f} epochs/s, the coordinator {quiet:.2f} cores")
            heads = ("sent MiB/s", "epochs/s", "ratio", "cores", "catch-up", "sink", "own")
            print(f"{'flood':<14}" + "".join(f"{h:>11}" for h in heads))
            for name, frames in chosen.items():
                # the machine's share first: the same flood into a bare ROUTER beside the run
                sink_stop, queue = mp.Event(), mp.Queue()
                drain = mp.Process(target=sink, args=(queue, sink_stop))
                drain.start()
                aside = flood_window(run_dir, run, queue.get(timeout=30), frames, args, pid)[0]
                sink_stop.set()
                drain.join()
                wait_epochs(run_dir, len(decided_at(run_dir)) + 2, run)  # settle
                pace, cores, ended, sent = flood_window(run_dir, run, endpoint, frames, args, pid)
                after = wait_epochs(run_dir, len(decided_at(run_dir)) + 1, run)[-1]
                catch_up = (after - ended) / per_epoch
                ratio, beside = pace * per_epoch, aside * per_epoch
                row = (f"{sent:.1f}", f"{pace:.2f}", f"{ratio:.2f}", f"{cores:.2f}")
                more = (f"{catch_up:.1f}", f"{beside:.2f}", f"{ratio / beside:.2f}")
                print(f"{name:<14}" + "".join(f"{v:>11}" for v in (*row, *more)))
                wait_epochs(run_dir, len(decided_at(run_dir)) + 2, run)  # settle before the next
        finally:
            run.terminate()
            run.wait(60)


if __name__ == "__main__":
    main()
