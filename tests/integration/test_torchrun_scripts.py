"""A script written for torchrun runs unchanged under ``epochal run``: it makes its own process
group from torchrun's variables and keeps its own loop (``scripts/torchrun_ddp.py``: DDP, a
DistributedSampler, nothing of epochal). The coordinator stands down with one line; the run is
finished when every worker exits 0, and a worker that fails stops the others."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
import torch

from epochal.launch.plainscript import PLAIN_LINE
from tests.integration.conftest import BOTH_STARTS, SCRIPTS, Spawner

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("torchrun-scripts")]  # one plain run

DEADLINE = 120.0
"""Generous: nothing in these runs times out; only a hang should reach it."""


def run_script(spawn: Spawner, tmp: Path, name: str, *extra: str) -> tuple[int, str, Path]:
    """``epochal run --nproc 2`` of ``scripts/torchrun_ddp.py`` with run directory ``TMP/NAME``
    and the weights in ``TMP/NAME.pt``: its status, its output and the weights' path."""
    out = tmp / f"{name}.pt"
    script = [str(SCRIPTS / "torchrun_ddp.py"), "--out", str(out), *extra]
    proc = spawn.epochal("run", "--nproc", "2", "--run-dir", str(tmp / name), *script)
    code, output = spawn.finish(proc, DEADLINE)
    spawn.assert_none_left()
    return code, output, out


def assert_same_weights(ours: Path, theirs: Path) -> None:
    a, b = torch.load(ours, weights_only=True), torch.load(theirs, weights_only=True)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, Path]:
    """The script as written, making its own process group, under ``epochal run`` (once for the
    module: both the torchrun and the join() variant are compared with it)."""
    tmp = tmp_path_factory.mktemp("plain")
    spawn = Spawner(uuid.uuid4().hex, tmp)
    try:
        return run_script(spawn, tmp, "epochal")
    finally:
        assert not spawn.cleanup()


def test_a_torchrun_script_runs_unchanged_and_trains_as_under_torchrun(
    plain: tuple[int, str, Path], spawn: Spawner, tmp_path: Path
):
    code, output, ours = plain
    assert code == 0, output
    assert output.count(PLAIN_LINE) == 1, output
    for rank in (0, 1):
        assert f"[rank {rank}] rank {rank} of 2, local rank {rank}" in output, output
        assert f"[rank {rank}] rank {rank}: epoch 2 loss" in output, output
    assert output.rstrip().endswith("done: 2 workers exited 0"), output

    # the same script under torchrun itself: the same weights, bit for bit
    proc = spawn.start(
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPTS / "torchrun_ddp.py"),
        "--out",
        str(tmp_path / "torchrun.pt"),
    )
    code, reference = spawn.finish(proc, DEADLINE)
    assert code == 0, reference
    assert_same_weights(ours, tmp_path / "torchrun.pt")


@BOTH_STARTS
def test_a_failing_worker_of_a_torchrun_script_stops_the_others(spawn: Spawner, tmp_path: Path):
    # rank 1 exits 3 once the group is made; rank 0 sleeps 600 s outside any collective
    started = time.monotonic()
    code, output, out = run_script(spawn, tmp_path, "run", "--fail-rank", "1")
    # rank 0 alone would sleep 600 s: stopped
    took = time.monotonic() - started
    assert code == 1, output
    assert output.count(PLAIN_LINE) == 1, output
    assert "FAILED: worker 1 exited with status 3; the others were stopped" in output, output
    assert not out.exists()
    print(f"rank 1 failed; every worker gone and the launcher out {took:.1f} s after the start")


def test_a_script_that_joins_only_for_its_process_group_finishes_when_its_sessions_close(
    plain: tuple[int, str, Path], spawn: Spawner, tmp_path: Path
):
    # the same script with epochal.join() in place of init_process_group(): the coordinator
    # holds the rendezvous, the script keeps its loop, and the run is finished, not aborted,
    # once every rank has closed its session
    code, output, joined = run_script(spawn, tmp_path, "joined", "--join")
    assert code == 0, output
    assert PLAIN_LINE not in output, output  # not taken for a torchrun script: it said hello
    assert output.count("closed its session without running epochs") == 1, output
    assert "finished: its workers ran their own loop, no epochs here" in output, output
    assert output.rstrip().endswith("done: 2 workers closed their sessions and exited 0"), output
    result = json.loads((tmp_path / "joined" / "result.json").read_text())
    assert (result["status"], result["epochs_run"]) == ("finished", 0), result
    # the same weights as the script making its own group (which the test above compares with
    # torchrun's)
    code, reference, ours = plain
    assert code == 0, reference
    assert_same_weights(joined, ours)
