"""Checkpoints in one process: every load checks the signed manifest first; the curve travels
along; the files are the user's alone; a forged file is refused before any byte of it is read."""

from __future__ import annotations

import json
import os
import random
import stat
from collections import namedtuple
from pathlib import Path

import numpy
import pytest
import torch
from torch import nn

from epochal.errors import EpochalError
from epochal.rundir.checkpointkey import CheckpointKey
from epochal.rundir.files import UnsafePath
from epochal.rundir.manifest import checkpoint_path
from epochal.worker.checkpoints.asyncsave import BackgroundSave, host_copy
from epochal.worker.checkpoints.checkpoint import CheckpointCorrupt, Checkpointer
from epochal.worker.checkpoints.state import WholeOnRoot
from tests.forgery import forge

# DCP without a process group: one process, which it says in a warning
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class State:
    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        self.model.load_state_dict(sd["model"])


def saved(tmp_path: Path) -> tuple[Checkpointer, nn.Module]:
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    ckpt = Checkpointer(tmp_path, rank=0, run_id="r")
    ckpt.save(3, State(model), history=[{"epoch": 3, "train_loss": 1.5}])
    return ckpt, model


def saved_now(tmp_path: Path) -> tuple[Checkpointer, nn.Module]:
    """A checkpoint of epoch 3 taken with the generators as they are."""
    model = nn.Linear(8, 8)
    ckpt = Checkpointer(tmp_path, rank=0, run_id="r")
    ckpt.save(3, State(model))
    return ckpt, model


def test_a_sound_checkpoint_loads_with_its_history(tmp_path: Path):
    ckpt, model = saved(tmp_path)
    other = nn.Linear(64, 64)
    assert ckpt.load(3, State(other)) == [{"epoch": 3, "train_loss": 1.5}]
    assert torch.equal(other.weight, model.weight)


@pytest.mark.parametrize("damage", ["zeroed", "truncated"])
@pytest.mark.parametrize("victim", ["*.distcp", "rank00000.pt"])
def test_a_damaged_checkpoint_is_refused_before_anything_is_loaded(
    tmp_path: Path, damage: str, victim: str
):
    ckpt, _ = saved(tmp_path)
    path = next(checkpoint_path(tmp_path, 3).glob(victim))
    data = bytearray(path.read_bytes())
    if damage == "zeroed":
        middle = len(data) // 2
        data[middle : middle + 4096] = bytes(len(data[middle : middle + 4096]))
    else:
        del data[-7:]
    path.write_bytes(bytes(data))
    fresh = nn.Linear(64, 64)
    before = fresh.weight.detach().clone()
    # the resume load (its rank's generators where the manifest lists them), a load that
    # requires them, and the best-weights load alike
    for rng in (None, True, False):
        with pytest.raises(CheckpointCorrupt, match=f"epoch 3 is unusable: .*{path.name}"):
            ckpt.load(3, State(fresh), rng=rng)
    assert torch.equal(fresh.weight, before)  # untouched


# ----------------------------------------------------------------------------- files of our own


def test_a_checkpoint_is_0700_with_0600_files_whatever_the_umask(tmp_path: Path):
    old = os.umask(0)  # DCP writes with the umask: the modes must not depend on it
    try:
        saved(tmp_path / "ckpt")
    finally:
        os.umask(old)
    path = checkpoint_path(tmp_path / "ckpt", 3)
    assert stat.S_IMODE((tmp_path / "ckpt").stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    names = {p.name: stat.S_IMODE(p.lstat().st_mode) for p in path.iterdir()}
    assert {".metadata", "rank00000.pt", "MANIFEST.json"} <= set(names)
    assert set(names.values()) == {0o600}, names
    assert not [n for n in names if n.startswith(".key-")]  # the ranks' key marks are gone


@pytest.mark.parametrize("when", ["save", "load"])
def test_a_checkpoint_directory_others_may_write_is_refused(tmp_path: Path, when: str):
    if when == "load":
        ckpt, _ = saved(tmp_path)
    else:
        ckpt = Checkpointer(tmp_path, rank=0, run_id="r")
    tmp_path.chmod(0o777)
    with pytest.raises(UnsafePath, match=f"{tmp_path} is writable by others"):
        if when == "save":
            ckpt.save(4, State(nn.Linear(64, 64)))
        else:
            ckpt.load(3, State(nn.Linear(64, 64)))


def test_the_rank_file_loads_with_weights_only_and_restores_every_generator(tmp_path: Path):
    random.seed(5)
    numpy.random.seed(6)
    torch.manual_seed(7)
    random.gauss(0, 1)  # a cached Gaussian in Python's state
    numpy.random.standard_normal()  # and in NumPy's
    ckpt, _ = saved_now(tmp_path)
    expected = (random.random(), numpy.random.random(), torch.rand(3))
    numpy.random.seed(0)
    random.seed(0)
    torch.manual_seed(0)
    path = checkpoint_path(tmp_path, 3)
    extra = torch.load(path / "rank00000.pt", weights_only=True)  # no pickle beyond the safe set
    assert extra["epoch"] == 3
    ckpt.load(3, State(nn.Linear(8, 8)))
    again = (random.random(), numpy.random.random(), torch.rand(3))
    assert again[:2] == expected[:2]
    assert torch.equal(again[2], expected[2])


# ----------------------------------------------------------------------------- forgeries


@pytest.mark.parametrize("name", ["rank00000.pt", ".metadata"])
def test_a_forged_file_with_a_recomputed_manifest_is_refused_unread(tmp_path: Path, name: str):
    ckpt, _ = saved(tmp_path / "ckpt")
    path = checkpoint_path(tmp_path / "ckpt", 3)
    marker = tmp_path / "ran"
    forge(path, name, marker)
    fresh = nn.Linear(64, 64)
    before = fresh.weight.detach().clone()
    for rng in (None, True, False):
        with pytest.raises(CheckpointCorrupt) as info:
            ckpt.load(3, State(fresh), rng=rng)
        assert f"{path / 'MANIFEST.json'} does not verify under the checkpoint key" in str(
            info.value
        )
    assert not marker.exists()
    assert torch.equal(fresh.weight, before)


def test_a_checkpoint_signed_with_another_key_is_refused(tmp_path: Path):
    theirs = CheckpointKey(secret=bytes(32), path=tmp_path / "their.key")
    Checkpointer(tmp_path / "ckpt", rank=0, run_id="r", key=theirs).save(3, State(nn.Linear(4, 4)))
    mine = Checkpointer(tmp_path / "ckpt", rank=0, run_id="r")
    with pytest.raises(CheckpointCorrupt, match=f"another checkpoint key \\(id '{theirs.key_id}'"):
        mine.load(3, State(nn.Linear(4, 4)))


def test_a_checkpoint_from_before_authentication_is_refused_saying_so(tmp_path: Path):
    ckpt, _ = saved(tmp_path)
    manifest = checkpoint_path(tmp_path, 3) / "MANIFEST.json"
    files = json.loads(manifest.read_text())["files"]
    manifest.write_text(json.dumps({"epoch": 3, "files": files}))  # the old, unsigned manifest
    with pytest.raises(CheckpointCorrupt, match="predates authenticated checkpoints"):
        ckpt.load(3, State(nn.Linear(64, 64)))


def test_ranks_with_different_keys_stop_the_run_at_its_first_checkpoint(tmp_path: Path):
    # rank 1 (on another machine, another home) marked the temporary directory with its key
    ckpt = Checkpointer(tmp_path, rank=0, run_id="r")
    tmp = tmp_path / "epoch-000000.tmp-r"
    tmp.mkdir(mode=0o700)
    (tmp / ".key-00001-0123456789abcdef").touch()
    with pytest.raises(EpochalError, match="rank\\(s\\) 1 use key id 0123456789abcdef") as info:
        ckpt.save(0, State(nn.Linear(4, 4)))
    assert "EPOCHAL_CHECKPOINT_KEY_FILE" in str(info.value)
    assert not checkpoint_path(tmp_path, 0).exists()  # nothing committed


def test_a_checkpoint_written_behind_holds_the_state_of_its_boundary(tmp_path: Path):
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    before = model.weight.detach().clone()
    ckpt = Checkpointer(tmp_path, rank=0, run_id="r")
    pending = ckpt.save_behind(3, WholeOnRoot(State(model)), history=[{"epoch": 3}])
    assert pending is not None
    with torch.no_grad():
        model.weight.add_(1.0)  # the next epoch trains while the copy is written
    pending.wait()
    other = nn.Linear(64, 64)
    assert ckpt.load(3, State(other)) == [{"epoch": 3}]
    assert torch.equal(other.weight, before)


def test_a_failed_background_write_is_raised_once_by_the_wait(tmp_path: Path):
    def fails() -> Path:
        raise OSError("disk full")

    pending = BackgroundSave(3, fails)
    with pytest.raises(OSError, match="disk full"):
        pending.wait()
    pending.wait()  # said once: the run has failed already


def test_a_host_copy_keeps_the_shape_of_the_state_and_copies_every_tensor() -> None:
    """Dicts, lists, tuples and named tuples keep their types; every tensor is a copy that the
    original's changes do not reach; ``check`` sees each tensor and may refuse it."""
    Pair = namedtuple("Pair", "weight steps")
    weight = torch.ones(2)
    state = {"w": [weight, (1, 2)], "pair": Pair(weight, 3)}
    copied = host_copy(state)
    weight.add_(1.0)
    assert type(copied["pair"]) is Pair and copied["pair"].steps == 3
    assert type(copied["w"][1]) is tuple and copied["w"][1] == (1, 2)
    assert torch.equal(copied["w"][0], torch.ones(2))
    assert torch.equal(copied["pair"].weight, torch.ones(2))

    def refuse(tensor: torch.Tensor) -> None:
        raise EpochalError(f"refused a tensor of shape {tuple(tensor.shape)}")

    with pytest.raises(EpochalError, match=r"shape \(2,\)"):
        host_copy(state, refuse)
