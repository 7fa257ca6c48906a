"""``epochal worker --torchrun``: a script written for torchrun, run unchanged on any machine.

Such a script calls ``torch.distributed.init_process_group()`` itself and keeps its own loop; it
never says hello to the coordinator. So this process does it for the script: it joins the run as
the script's rank (the coordinator's rendezvous, model check by an empty model, admission, CURVE
and the token as for any worker), finds the data-plane store rank 0 opened, and there agrees on
the address the script's own process group meets at (``MASTER_ADDR`` rank 0's data-plane address,
``MASTER_PORT`` a port rank 0 found free). It then starts the script with torchrun's variables
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) and the data plane's interface (``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``),
and stays the rank's member of the run while it trains: heartbeats, the script's CPU as its
progress, and

- the script exits 0: this rank is done; the run is finished when every rank is (the coordinator
  says ``finished: its workers ran their own loop``);
- the script fails: the coordinator hears why (``Failed``) and stops the other ranks, as it does
  for any failed worker, within the usual bound;
- the run is aborted (another rank failed, the coordinator's own reason): the script gets SIGTERM,
  then SIGKILL ``abort_grace`` seconds later, and this process ends with the abort's one line.

What needs ``epochal.train()`` or ``epochal.join()`` is said once at the start (:data:`FEATURES`).
The script runs in this process's process group, so the supervisor's signals reach it directly.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import torch

from epochal.environment import COORDINATOR_ENV
from epochal.errors import RunAborted
from epochal.log import WORKER
from epochal.protocol import Failed, Finish, Phase, clip
from epochal.text import exit_words
from epochal.worker.control.admission import StoreRef
from epochal.worker.control.finish import finish_without_epochs
from epochal.worker.control.progress import CpuProgress, process_cpu
from epochal.worker.dataplane import network
from epochal.worker.dataplane.store import scoped
from epochal.worker.fingerprint import describe
from epochal.worker.join import admit
from epochal.worker.joinoptions import (
    JoinOptions,
)

FEATURES = (
    "this torchrun script runs as it is: epochal joins the run for it, gives it torchrun's "
    "variables and stops every rank if one fails; epochs decided for every rank, checkpoints and "
    "resume, schedules, early stopping and elastic runs need epochal.train() or epochal.join()"
)
"""The line rank 0 says once at the start."""

MASTER_PORT_KEY = "torchrun/master_port"
"""Where rank 0 leaves the port the script's process group meets at, in the data-plane store."""

POLL = 0.5
"""Seconds between two looks at the script while it runs."""


def master(store: StoreRef, run_id: str, rank: int, host: str) -> tuple[str, int]:
    """The address the script's process group meets at: rank 0's data-plane host and a port it
    found free there, agreed through the run's data-plane store (the other ranks wait for it)."""
    shared = scoped(store.store, run_id, store.key)
    if rank == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
            port = int(probe.getsockname()[1])
        shared.set(MASTER_PORT_KEY, str(port))
        return host, port
    return store.host, int(shared.get(MASTER_PORT_KEY).decode())


def script_environment(
    base: dict[str, str],
    plane: network.DataPlane,
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    address: tuple[str, int],
) -> dict[str, str]:
    """What torchrun gives a worker, for the script: its rank in the run, the world, the
    rendezvous address and the data plane's interface. The coordinator's address is left out:
    the script does not talk to it (this process does)."""
    env = dict(base)
    env.pop(COORDINATOR_ENV, None)
    network.apply(plane, env)
    env["RANK"] = env["GROUP_RANK"] = str(rank)
    env["LOCAL_RANK"] = str(local_rank)
    env["WORLD_SIZE"] = str(world_size)
    env["LOCAL_WORLD_SIZE"] = "1"  # one worker per `epochal worker`
    env["MASTER_ADDR"], env["MASTER_PORT"] = address[0], str(address[1])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def stop(script: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM the script, SIGKILL it ``grace`` seconds later if it is still running."""
    if script.poll() is None:
        script.send_signal(signal.SIGTERM)
        try:
            script.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            script.kill()
            script.wait()


def run(command: Sequence[str]) -> int:
    """Join the run for ``command`` (a torchrun script), run it, and return its exit status."""
    options = JoinOptions.from_env()
    where = options.placement
    admitted, meet = admit(
        options,
        describe(torch.nn.Module()).fingerprint,  # the same for every such rank
        cuda=torch.cuda.is_available(),
        then=lambda a: master(a.store, a.welcome.run_id, a.welcome.rank, a.plane.address),
    )
    client, welcome, plane = admitted.client, admitted.welcome, admitted.plane
    rank = welcome.rank
    if rank == 0:
        WORKER.info(f"epochal: {FEATURES}")
    env = script_environment(
        dict(os.environ),
        plane,
        rank=rank,
        world_size=welcome.world_size,
        local_rank=where.local_rank,
        address=meet,
    )
    script = subprocess.Popen(list(command), env=env, stdin=subprocess.DEVNULL)
    client.busy = CpuProgress(functools.partial(process_cpu, script.pid))
    client.at(Phase.TRAIN, welcome.start_epoch)
    finish: Finish | None = None  # another rank's script ended first: the run is finishing
    try:
        while (code := script.poll()) is None:
            try:
                message = client.receive(timeout=POLL)
            except TimeoutError:
                continue
            if isinstance(message, Finish):
                finish = message
                continue
            # a world change (an elastic run): a torchrun script cannot follow one
            raise RunAborted(
                f"the coordinator sent {type(message).__name__}: the run's world changes, which "
                "a torchrun script cannot follow (elastic runs need epochal.train() or "
                "epochal.join())"
            )
    except BaseException:
        stop(script, options.abort_grace)
        client.close(flush=0.5)
        raise
    client.busy = None
    if code != 0:
        what = f"its torchrun script {exit_words(code)}"
        WORKER.error(f"epochal: rank {rank}: {what}")
        client.send(Failed(reason=clip(what)))
        client.close(flush=2.0)
        return code if code > 0 else 128 - code
    try:
        finish_without_epochs(client, rank, welcome.start_epoch, finish)
    finally:
        client.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["--"]:
        words = words[1:]
    if not words:
        print("usage: python -m epochal.worker.plain [--] COMMAND ...", file=sys.stderr)
        return 2
    started = time.monotonic()
    code = run(words)
    WORKER.debug(f"epochal: the script ran for {time.monotonic() - started:.1f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
