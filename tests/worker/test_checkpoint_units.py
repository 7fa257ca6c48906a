"""Checkpoints in one process: every load checks the manifest; the curve travels along."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from epochal.manifest import checkpoint_path
from epochal.worker.checkpoint import CheckpointCorrupt, Checkpointer

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
    for rng in (True, False):  # the resume load and the best-weights load alike
        with pytest.raises(CheckpointCorrupt, match=f"epoch 3 is unusable: .*{path.name}"):
            ckpt.load(3, State(fresh), rng=rng)
    assert torch.equal(fresh.weight, before)  # untouched
