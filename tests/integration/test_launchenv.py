"""Workers started by a batch system: the coordinator's address from a file, places from Slurm."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import BOTH_STARTS, Spawner

pytestmark = pytest.mark.slow

DEADLINE = 90.0
CONNECT_TIMEOUT = 60


def slurm_task(procid: int, ntasks: int) -> dict[str, str]:
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(procid),
        "SLURM_NTASKS": str(ntasks),
    }


@BOTH_STARTS
def test_workers_wait_for_the_address_file_and_take_their_ranks_from_slurm(
    spawn: Spawner, tmp_path: Path
) -> None:
    address = tmp_path / "shared" / "coordinator.addr"
    address.parent.mkdir()
    workers = {
        procid: spawn.script(
            "linear.py",
            EPOCHAL_COORDINATOR=f"file:{address}",
            EPOCHAL_CONNECT_TIMEOUT=str(CONNECT_TIMEOUT),
            **slurm_task(procid, 2),
        )
        for procid in (1, 0)  # started before the coordinator, and in reverse order
    }
    for worker in workers.values():  # the first thing each says; bounded by its connect timeout
        assert worker.stdout is not None
        waiting = worker.stdout.readline()
        assert f"waiting up to {CONNECT_TIMEOUT} s for the coordinator's address in" in waiting
    coordinator = spawn.epochal(
        "coordinator",
        "--bind",
        "tcp://127.0.0.1:0",
        "--address-file",
        str(address),
        "--world-size",
        "2",
        "--epochs",
        "2",
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert coordinator.stdout is not None
    listening = coordinator.stdout.readline()
    endpoint = listening.split()[-1]
    where = coordinator.stdout.readline()  # the run's directory, then the address file
    assert where.startswith("epochal: run ") and str(tmp_path / "run") in where, where
    written = coordinator.stdout.readline()
    assert f"{endpoint} written to {address}" in written, written
    for procid, worker in workers.items():
        code, output = spawn.finish(worker, DEADLINE)
        assert code == 0, output
        assert f"rank {procid}: best epoch" in output, output
    code, output = spawn.finish(coordinator, DEADLINE)
    assert code == 0, output
    assert not address.exists(), "the coordinator removes its address file when the run ends"
    spawn.assert_none_left()


def test_a_world_size_other_than_the_launchers_is_refused_naming_both(
    spawn: Spawner, tmp_path: Path
) -> None:
    address = tmp_path / "coordinator.addr"
    coordinator = spawn.epochal(
        "coordinator",
        "--address-file",
        str(address),
        "--world-size",
        "2",
        "--epochs",
        "2",
        "--run-dir",
        str(tmp_path / "run"),
    )
    workers = [
        spawn.script(
            "linear.py",
            EPOCHAL_COORDINATOR=f"file:{address}",
            EPOCHAL_CONNECT_TIMEOUT=str(CONNECT_TIMEOUT),
            **slurm_task(procid, 3),
        )
        for procid in (0, 1)
    ]
    needle = "started for a world of 3 workers (Slurm (SLURM_NTASKS=3))"
    for worker in workers:
        code, output = spawn.finish(worker, DEADLINE)
        assert code != 0
        assert needle in output and "coordinator runs a world of 2" in output, output
    code, output = spawn.finish(coordinator, DEADLINE)
    assert code == 1, output
    assert needle in output, output
    spawn.assert_none_left()
