"""Checkpoints written behind training, in one process: the commit is told from the writer's
thread as soon as the rename is durable, before the next boundary; the writer's error is raised
once, by the next settle; which modes' states rank 0 alone may write."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from epochal.protocol import Checkpointed
from epochal.rundir.manifest import MANIFEST, checkpoint_path
from epochal.worker.checkpoints.checkpoint import Checkpointer
from epochal.worker.checkpoints.state import WholeOnRoot, whole_on_root
from epochal.worker.sessionparts.exchange import Exchange
from epochal.worker.sessionparts.savepoints import Savepoints
from epochal.worker.strategies import wrap
from epochal.worker.training.precision import ScaledState

# the synchronous saves here are DCP without a process group, which it says in a warning
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class State:
    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])


class Client:
    """The control client's send, noting each message with the thread that sent it and whether
    the checkpoint it names was in place then."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.sent: list[tuple[Any, int, bool]] = []

    def send(self, message: Any) -> None:
        path = checkpoint_path(self.directory, getattr(message, "epoch", 0))
        self.sent.append((message, threading.get_ident(), (path / MANIFEST).exists()))


def savepoints(tmp_path: Path, told: Any) -> Savepoints:
    checkpointer = Checkpointer(tmp_path, rank=0, run_id="r")
    standing = SimpleNamespace(checkpointer=checkpointer, resume_epoch=None, rank=0)
    return Savepoints(standing, told)  # type: ignore[arg-type]


def test_the_commit_is_told_from_the_writer_once_durable_before_the_next_boundary(
    tmp_path: Path,
):
    client = Client(tmp_path)
    exchange = Exchange(client, SimpleNamespace(generation=0))  # type: ignore[arg-type]
    points = savepoints(tmp_path, exchange.committed)
    points.save(2, WholeOnRoot(State(nn.Linear(32, 32))), [])
    deadline = time.monotonic() + 60
    while not client.sent and time.monotonic() < deadline:  # no settle: nothing on this thread
        time.sleep(0.01)
    ((message, sender, in_place),) = client.sent
    assert message == Checkpointed(epoch=2)
    assert sender != threading.get_ident()  # the writer's thread said it
    assert in_place  # once the checkpoint was renamed into place, its manifest in it
    points.settle()
    assert len(client.sent) == 1  # said once, by the writer
    assert exchange.say_again() == ["the commit of the checkpoint of epoch 2"]
    assert client.sent[-1][0] == Checkpointed(epoch=2)  # and again to a restarted coordinator


def test_a_state_not_whole_on_root_is_committed_and_told_at_the_boundary(tmp_path: Path):
    told: list[tuple[int, int]] = []
    points = savepoints(tmp_path, lambda epoch: told.append((epoch, threading.get_ident())))
    points.save(1, State(nn.Linear(4, 4)), [])
    assert told == [(1, threading.get_ident())]


def test_the_writer_s_error_is_raised_once_by_the_next_settle_and_nothing_is_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    def full(*args: Any) -> Path:
        raise OSError("disk full")

    monkeypatch.setattr(Checkpointer, "_commit", full)
    told: list[int] = []
    points = savepoints(tmp_path, told.append)
    points.save(0, WholeOnRoot(State(nn.Linear(4, 4))), [])  # returns: the write is behind
    with pytest.raises(OSError, match="disk full"):
        points.settle()
    points.settle()  # said once: the run has failed already
    assert told == []
    assert not checkpoint_path(tmp_path, 0).exists()


def test_a_failing_run_drains_the_writer_without_its_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    def full(*args: Any) -> Path:
        raise OSError("disk full")

    monkeypatch.setattr(Checkpointer, "_commit", full)
    points = savepoints(tmp_path, lambda epoch: None)
    points.save(0, WholeOnRoot(State(nn.Linear(4, 4))), [])
    points.drain()  # the run's own failure is what it reports
    points.settle()


def test_the_next_save_waits_for_the_previous_write(tmp_path: Path):
    told: list[int] = []
    points = savepoints(tmp_path, told.append)
    model = nn.Linear(16, 16)
    points.save(0, WholeOnRoot(State(model)), [])
    points.save(1, WholeOnRoot(State(model)), [])  # settles epoch 0's first
    assert told[:1] == [0]
    points.settle()
    assert told == [0, 1]


def test_a_commit_leaves_the_next_checkpoint_s_temporary_directory_alone(tmp_path: Path):
    older = tmp_path / "epoch-000001.tmp-crashed"  # an earlier attempt's leftover
    later = tmp_path / "epoch-000003.tmp-r"  # begun by the ranks ahead while rank 0 writes 2
    for leftover in (older, later):
        leftover.mkdir(mode=0o700, parents=True)
    tmp_path.chmod(0o700)
    told: list[int] = []
    points = savepoints(tmp_path, told.append)
    points.save(2, WholeOnRoot(State(nn.Linear(4, 4))), [])
    points.settle()
    assert told == [2]
    assert not older.exists()
    assert later.exists()


@pytest.fixture
def one_rank(tmp_path: Path):
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "s"), 1), rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(
    ("mode", "whole"),
    [("replicated", True), ("main", True), ("sharded", False), ("fully_sharded", False)],
)
def test_rank_0_writes_alone_where_its_state_is_the_whole(one_rank, mode: str, whole: bool):
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    strategy = wrap(model, optimizer, torch.device("cpu"), mode=mode)
    assert whole_on_root(strategy.state) is whole
    scaled = ScaledState(strategy.mode_state, torch.amp.GradScaler("cpu"))
    assert whole_on_root(scaled) is whole  # fp16's scaler: the same on every rank
