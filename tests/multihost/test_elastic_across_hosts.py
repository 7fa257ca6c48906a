"""An elastic run across hosts (network namespaces, CURVE on, no hints): ``epochal coordinator
--world-size 2 --min-workers 1`` on one host and ``epochal worker --max-restarts 1`` on two
others. A worker's script is killed mid-epoch: the other carries on alone from the start of that
epoch, the killed worker's supervisor starts it again, and the new process waits as a standby and
joins at the next epoch boundary with rank 0's state, sent over the data plane between the
hosts. No checkpoint is read, the survivor never restarts, and both end with the same weights.
And a cut link instead of a killed script: the other carries on, the cut-off worker ends; and a
killed worker of a sharded run: the other loads the last checkpoint, resharded to one rank; and
a frozen worker, dropped by its silence and refused once it wakes; and a whole host of two
workers cut off (four workers on two hosts): one change, the other host's two carrying on, or the
end of the run naming both where that leaves fewer than ``--min-workers``."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.multihost.test_across_hosts import (
    ABORT_GRACE,
    HEARTBEAT_INTERVAL,
    MARGIN,
    RUN_DEADLINE,
    WORKER_HEARTBEAT_TIMEOUT,
    Cluster,
    journal_has,
)
from tests.waiting import wait_until

LINEAR = Path(__file__).resolve().parents[1] / "integration" / "scripts" / "linear.py"
EPOCHS = 40

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.parametrize(
    ("mode", "killed"),
    [("replicated", 0), ("fully_sharded", 1)],
    ids=["replicated-rank-0-the-store-host", "fully_sharded"],
)
def test_a_killed_worker_rejoins_at_a_boundary_and_the_other_never_stops(
    make_hosts, tmp_path, mode, killed
):
    """Rank 0 killed: the other becomes rank 0 and hosts the new world's store on its own host,
    which the newcomer then reaches from another. In fully_sharded the survivor loads the killed
    worker's shard from the checkpoint of epoch 0, and at the boundary it gathers the whole state
    and sends it to the newcomer's host, which keeps its shard of each tensor."""
    net = make_hosts(3)
    cluster = Cluster(net, tmp_path)
    run_dir, out = tmp_path / "run", tmp_path / "out"
    coordinator = cluster.coordinator(
        "--min-workers",
        "1",
        "--epochs",
        str(EPOCHS),
        "--no-restore-best",
        "--run-dir",
        str(run_dir),
    )
    supervisor = ["python", "-m", "epochal", "worker", "--connect", cluster.endpoint]
    supervisor += ["--max-restarts", "1", "--"]
    # epochs of about a second while the world is short of a worker, fast once it is whole
    work = ["python", str(LINEAR), "--out", str(out), "--step-delay", "0.25", "--slow-below", "2"]
    work += ["--parallel", mode]
    fault = f"kill@train-step:rank={killed}:epoch=1:step=2:world=0"
    workers = [cluster.worker(i, [*supervisor, *work], EPOCHAL_FAULT=fault) for i in range(2)]
    outputs = [cluster.wait(w) for w in workers]
    log = cluster.wait(coordinator)
    assert coordinator.returncode == 0, cluster.dump()
    assert all(w.returncode == 0 for w in workers), cluster.dump()
    assert "resuming" not in log, log  # nothing read from a checkpoint
    changes = json.loads((run_dir / "result.json").read_text())["world_changes"]
    lost, joined = changes
    assert (lost["epoch"], lost["from"], lost["to"], lost["joined"]) == (1, 2, 1, []), changes
    assert (joined["from"], joined["to"], joined["lost"]) == (1, 2, []), changes
    assert joined["epoch"] >= 2 and joined["restore"] == "peers", changes
    assert lost["restore"] == ("memory" if mode == "replicated" else "checkpoint"), changes
    assert lost["lost"][0].startswith(f"rank {killed} "), changes
    again, survivor = outputs[killed], outputs[1 - killed]
    assert "restart 1 of 1" in again, again
    assert "took rank 0's state" in again, again
    assert f"rank {1 - killed} is rank 0 of 1 in world 1" in survivor, survivor
    # the survivor never restarted; the other ends with its weights, bit for bit
    assert "restart" not in survivor, survivor
    final = {r: torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1)}
    for key, tensor in final[0]["state"].items():
        assert torch.equal(tensor, final[1]["state"][key]), key
    cluster.none_left()


def host_cut_off(make_hosts, tmp_path: Path, *, places: list[int], least: int, epochs: int):
    """A coordinator on host 0 and a worker on each host of ``places`` (``--min-workers
    LEAST``, every step slow: whenever the cut comes, the workers are in an epoch or between
    two); once epoch 0 is decided, the link of host 2 goes down and every worker there falls
    silent at once. Each cut-off worker must end by itself within the bound its own timeouts set:
    blocked in a collective, it waits the re-attach window too (a peer may bring the decision it
    missed from a restarted coordinator), then ends itself. The cluster, the coordinator's
    process, the other workers' and the run directory."""
    net = make_hosts(3)
    cluster = Cluster(net, tmp_path, workers=len(places))
    cluster.places = places
    run_dir, out = tmp_path / "run", tmp_path / "out"
    coordinator = cluster.coordinator(
        *("--min-workers", str(least), "--epochs", str(epochs), "--no-restore-best"),
        *("--run-dir", str(run_dir)),
    )
    work = ["python", str(LINEAR), "--out", str(out), "--step-delay", "0.1"]
    extra = {"EPOCHAL_REATTACH_TIMEOUT": f"{ABORT_GRACE:g}"}
    workers = [cluster.worker(i, work, **extra) for i in range(len(places))]
    journal_has(run_dir, "epoch")
    net[2].link(up=False)
    cut = time.monotonic()
    bound = WORKER_HEARTBEAT_TIMEOUT + 2 * ABORT_GRACE + HEARTBEAT_INTERVAL + MARGIN
    for proc, place in zip(workers, places, strict=True):
        if place == 2:
            cut_off = cluster.wait(proc, deadline=bound + 30)
            assert time.monotonic() - cut < bound, cut_off
            assert proc.returncode != 0, cut_off
    others = [proc for proc, place in zip(workers, places, strict=True) if place != 2]
    return cluster, coordinator, others, run_dir


def test_a_cut_link_leaves_the_other_training_and_the_cut_off_worker_ends_by_itself(
    make_hosts, tmp_path
):
    """The link of one worker's host goes down mid-run: no process exits and no connection
    closes, so the coordinator finds the rank by its silence (the heartbeat timeout) and the
    other carries on alone from the start of the epoch; the cut-off worker, which hears from
    nobody, ends by itself within the bound its own timeouts set."""
    cluster, coordinator, others, run_dir = host_cut_off(
        make_hosts, tmp_path, places=[1, 2], least=1, epochs=6
    )
    (worker,) = others
    survivor = cluster.wait(worker)
    log = cluster.wait(coordinator)
    assert coordinator.returncode == 0, cluster.dump()
    assert worker.returncode == 0, survivor
    (change,) = json.loads((run_dir / "result.json").read_text())["world_changes"]
    assert (change["from"], change["to"], change["restore"]) == (2, 1, "memory"), change
    assert change["lost"][0].startswith("rank 1 ") and "sent nothing for" in change["lost"][0]
    assert "continuing with 1 worker from the start of epoch" in log, log
    assert "is rank 0 of 1 in world 1" in survivor, survivor
    cluster.none_left()


def test_a_host_lost_with_two_workers_leaves_the_other_host_s_two_training(make_hosts, tmp_path):
    """``--min-workers 2``: the coordinator finds the two cut off by their silence, which ends up
    to a heartbeat interval apart, and drops both in one change (the first silence holds the
    change open while a rank is unheard since); the other host's two carry on from the start of
    the epoch, restored from memory, and finish with the same weights."""
    cluster, coordinator, others, run_dir = host_cut_off(
        make_hosts, tmp_path, places=[1, 1, 2, 2], least=2, epochs=5
    )
    survivors = [cluster.wait(proc) for proc in others]
    log = cluster.wait(coordinator)
    assert coordinator.returncode == 0, cluster.dump()
    assert all(proc.returncode == 0 for proc in others), survivors
    (change,) = json.loads((run_dir / "result.json").read_text())["world_changes"]
    assert (change["from"], change["to"], change["restore"]) == (4, 2, "memory"), change
    lost = change["lost"]
    assert [loss.split(" (")[0] for loss in lost] == ["rank 2", "rank 3"], change
    assert all("sent nothing for" in loss for loss in lost), change
    assert log.count("continuing with 2 workers from the start of epoch") == 2, log
    records = [json.loads(line) for line in (run_dir / "epochs.jsonl").read_text().splitlines()]
    assert [r["world_size"] for r in records if r["kind"] == "epoch"][-1] == 2, records
    out = tmp_path / "out"
    final = {r: torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1)}
    for key, tensor in final[0]["state"].items():
        assert torch.equal(tensor, final[1]["state"][key]), key
    cluster.none_left()


def test_a_host_lost_below_the_least_ends_the_run_naming_both_its_workers(make_hosts, tmp_path):
    """``--min-workers 3``: the same cut leaves two, fewer than three: the run aborts in one
    change naming both lost ranks, and the other host's two end with that reason."""
    cluster, coordinator, others, run_dir = host_cut_off(
        make_hosts, tmp_path, places=[1, 1, 2, 2], least=3, epochs=5
    )
    for proc in others:
        cluster.wait(proc)
        assert proc.returncode != 0, cluster.dump()
    log = cluster.wait(coordinator)
    assert coordinator.returncode != 0, cluster.dump()
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "aborted", result
    reason = result["reason"]
    assert "rank 2 (" in reason and "rank 3 (" in reason, reason
    assert "2 workers left, fewer than --min-workers 3" in reason, reason
    assert "continuing with" not in log, log
    cluster.none_left()


def frozen_scripts() -> list[int]:
    """Processes of linear.py frozen by SIGSTOP (state T), whatever their host."""
    frozen = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if str(LINEAR).encode() not in (entry / "cmdline").read_bytes():
                continue
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
                frozen.append(int(entry.name))
        except OSError:
            continue
    return frozen


def test_a_frozen_worker_is_dropped_and_woken_it_is_refused_across_hosts(make_hosts, tmp_path):
    """A worker frozen (SIGSTOP) mid-step on its host keeps its connections open: the coordinator
    drops it after the heartbeat timeout and the other carries on alone from the start of the
    epoch; woken once the new world exists, the frozen worker is refused in one line and ends."""
    net = make_hosts(3)
    cluster = Cluster(net, tmp_path)
    run_dir, out = tmp_path / "run", tmp_path / "out"
    coordinator = cluster.coordinator(
        "--min-workers", "1", "--epochs", "4", "--no-restore-best", "--run-dir", str(run_dir)
    )
    work = ["python", str(LINEAR), "--out", str(out)]
    fault = "stop@train-step:rank=1:epoch=1:step=2:world=0"
    workers = [cluster.worker(i, work, EPOCHAL_FAULT=fault) for i in range(2)]
    wait_until(frozen_scripts, RUN_DEADLINE, cluster.dump)
    frozen = frozen_scripts()  # stopped until the SIGCONT below
    journal_has(run_dir, "world")
    os.kill(frozen[0], signal.SIGCONT)
    woken = cluster.wait(workers[1])
    survivor = cluster.wait(workers[0])
    log = cluster.wait(coordinator)
    assert coordinator.returncode == 0, cluster.dump()
    assert workers[0].returncode == 0, survivor
    assert workers[1].returncode != 0, woken
    assert "this worker was dropped from the run" in woken, woken
    (change,) = json.loads((run_dir / "result.json").read_text())["world_changes"]
    assert (change["epoch"], change["from"], change["to"]) == (1, 2, 1), change
    assert change["lost"][0].startswith("rank 1 ") and "sent nothing for" in change["lost"][0]
    assert "continuing with 1 worker from the start of epoch 1" in log, log
    cluster.none_left()


def test_a_lost_shard_across_hosts_is_restored_from_the_shared_checkpoint(make_hosts, tmp_path):
    """``sharded`` (ZeRO) across hosts: a killed worker takes its shard of the optimizer with it,
    so the other loads the last committed checkpoint, which every host sees, resharded to one
    rank, and carries on from the epoch after it."""
    net = make_hosts(3)
    cluster = Cluster(net, tmp_path)
    run_dir, out = tmp_path / "run", tmp_path / "out"
    coordinator = cluster.coordinator(
        "--min-workers", "1", "--epochs", "4", "--no-restore-best", "--run-dir", str(run_dir)
    )
    work = ["python", str(LINEAR), "--out", str(out), "--parallel", "sharded"]
    fault = "kill@train-step:rank=1:epoch=2:step=1:world=0"
    workers = [cluster.worker(i, work, EPOCHAL_FAULT=fault) for i in range(2)]
    survivor = cluster.wait(workers[0])
    cluster.wait(workers[1])
    log = cluster.wait(coordinator)
    assert coordinator.returncode == 0, cluster.dump()
    assert workers[0].returncode == 0, survivor
    (change,) = json.loads((run_dir / "result.json").read_text())["world_changes"]
    assert (change["epoch"], change["from"], change["to"]) == (2, 2, 1), change
    assert (change["restore"], change["checkpoint"]) == ("checkpoint", 1), change
    assert "continuing with 1 worker from the checkpoint of epoch 1" in log, log
    assert "epoch 2 again from the checkpoint of epoch 1" in survivor, survivor
    records = [json.loads(line) for line in (run_dir / "epochs.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["world_size"]) for r in records if r["kind"] == "epoch"] == [
        (0, 2),
        (1, 2),
        (2, 1),
        (3, 1),
    ]
    cluster.none_left()
