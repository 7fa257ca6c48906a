"""The regroup package's parts that need no peers: the wire format (JSON and tensor slots, what a
malformed one gets), the chunks tensors travel in, which losses a mode restores from memory,
clearing an error's frames; and, in one spawned rank, that a snapshot taken before the optimizer
has any state changes nothing of the training that follows, and restores that state of no state.
"""

from __future__ import annotations

import gc
import json
import math
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from epochal.errors import ConfigError, EpochalError
from epochal.protocol import SnapshotScope
from epochal.worker.regroup import Snapshot, clear_frames
from epochal.worker.regroup.wire import Slot, _chunks, _fill, decode, encode
from epochal.worker.strategies import wrap
from epochal.worker.training.elastic import elastic_scope
from tests.worker.elastic import (
    CPU,
    form_group,
    load,
    make_model,
    make_optimizer,
    record,
    same,
    save,
    spawn,
    train_epoch,
)
from tests.worker.ranks import RANKS

# ---------------------------------------------------------------- the wire format


def optimizer_like() -> dict[str, Any]:
    return {
        "state": {
            0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, 3)},
            "1.weight": {"mask": torch.tensor([True, False]), "count": torch.arange(4)},
        },
        "param_groups": [
            {"lr": 0.05, "betas": (0.9, 0.999), "foreach": None, "params": [0, "1.weight"]},
            {"lr": math.inf, "eps": -math.inf, "maximize": False, "nan": math.nan},
        ],
        "half": torch.ones(2, dtype=torch.float16),
    }


def test_a_structure_decodes_to_the_same_shape_with_a_slot_per_tensor():
    tree = optimizer_like()
    data, tensors = encode(tree)
    skeleton, slots = decode(data)
    assert [s.index for s in slots] == list(range(len(tensors)))
    assert [(s.shape, s.dtype) for s in slots] == [(tuple(t.shape), t.dtype) for t in tensors]
    assert slots[0].path == ("state", 0, "step") and slots[0].nbytes == 4
    assert slots[-1].path == ("half",)
    back = _fill(skeleton, {s.index: tensors[s.index] for s in slots})
    nan = back["param_groups"][1].pop("nan")
    assert math.isnan(nan)
    del tree["param_groups"][1]["nan"]
    same(back, tree)  # tuples stay tuples, int keys stay ints, infinities stay infinite


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"{not json", "malformed"),
        (json.dumps({"tensor": [1, [2], "float32"]}).encode(), "tensor 1"),
        (json.dumps({"tensor": [0, [2], "object"]}).encode(), "dtype 'object'"),
        (json.dumps({"tensor": [0, [-1], "float32"]}).encode(), "shape"),
        (json.dumps({"tensor": [0, [True], "float32"]}).encode(), "shape"),
        (json.dumps({"pickle": []}).encode(), "unknown kind"),
        (json.dumps({"dict": [[{"list": []}, 1]]}).encode(), "key"),
        (json.dumps({"dict": [[1]]}).encode(), "pair"),
        (json.dumps([1, 2]).encode(), "unexpected list"),
        (b"[" * 100_000, "malformed"),
    ],
)
def test_a_malformed_structure_is_refused_with_what_is_wrong(data, says):
    with pytest.raises(EpochalError, match="malformed") as raised:
        decode(data)
    assert says in str(raised.value)


@pytest.mark.parametrize(
    ("tree", "says"),
    [
        ({"a": object()}, "holds a object"),
        ({"a": torch.zeros(1, dtype=torch.float8_e4m3fn)}, "dtype"),
        ({(1, 2): 3}, "key of type tuple"),
    ],
)
def test_what_the_wire_cannot_carry_is_refused_before_anything_is_sent(tree, says):
    with pytest.raises(EpochalError, match=says):
        encode(tree)


def slot(index: int, nbytes: int) -> Slot:
    return Slot(index, (nbytes,), torch.uint8, (index,))


def test_tensors_travel_in_runs_under_the_cap_a_larger_one_alone():
    slots = [slot(0, 4), slot(1, 4), slot(2, 10), slot(3, 1), slot(4, 8)]
    runs = [[s.index for s in run] for run in _chunks(slots, 8)]
    assert runs == [[0, 1], [2], [3], [4]]
    assert _chunks([], 8) == []


# ---------------------------------------------------------------- modes, errors


class Held:
    """Stands for a DDP wrapper a failed step's frames keep alive."""


def test_clearing_an_errors_frames_lets_what_they_held_go():
    refs: list[weakref.ref[Held]] = []

    def step(held: Held) -> None:
        raise RuntimeError("Connection closed by peer")

    def train() -> None:
        wrapper = Held()
        refs.append(weakref.ref(wrapper))
        step(wrapper)

    try:
        train()
    except RuntimeError as exc:
        error = exc
    (alive,) = refs
    gc.collect()
    assert alive() is not None  # the traceback holds it
    clear_frames(error)
    gc.collect()
    assert alive() is None
    assert "Connection closed" in str(error)


# ---------------------------------------------------------------- a snapshot in a real rank


def alone(index: int, tmp: Path) -> None:
    form_group(tmp, 0, 0, 1)
    out = {}
    for mode in ("replicated", "main"):
        runs = {}
        for name in ("plain", "snapshot"):
            model = make_model(1)
            strategy = wrap(model, make_optimizer(model), CPU, mode=mode)
            before = record(strategy)
            snapshot = Snapshot.take(strategy) if name == "snapshot" else None
            for epoch in range(2):
                train_epoch(strategy, epoch, 0, 1)
            runs[name] = record(strategy)
            if snapshot is not None:
                snapshot.restore(strategy)
                runs["restored"], runs["before"] = record(strategy), before
        out[mode] = runs
    save(tmp, "alone", out)
    dist.destroy_process_group()


@pytest.mark.slow
@RANKS
def test_a_snapshot_before_the_first_step_changes_nothing_and_restores_no_optimizer_state(
    tmp_path,
):
    spawn(alone, 1, tmp_path, deadline=120)
    for mode, runs in load(tmp_path, "alone").items():
        assert runs["plain"]["optim"]["state"], mode  # AdamW: a step count, two moments
        same(runs["snapshot"], runs["plain"], mode)
        assert runs["restored"]["optim"]["state"] == {}
        same(runs["restored"], runs["before"], mode)


@pytest.mark.parametrize(
    ("mode", "scope", "snapshot", "said"),
    [
        ("sharded", SnapshotScope.SHARD, True, "mode 'sharded' keeps a shard of the state"),
        ("replicated", SnapshotScope.WHOLE, False, "snapshot=False keeps no copy"),
    ],
)
def test_an_elastic_run_restoring_checkpoints_without_a_checkpoint_directory_is_refused(
    mode, scope, snapshot, said
):
    with pytest.raises(ConfigError) as refused:
        elastic_scope(mode, scope, snapshot=snapshot, checkpoints=False)
    assert said in str(refused.value)
    assert "Give the run a --run-dir or --checkpoint-dir" in str(refused.value)
    assert elastic_scope(mode, scope, snapshot=snapshot, checkpoints=True) is (
        scope if snapshot else SnapshotScope.OFF
    )
    # copies that hold the whole state need no checkpoint
    assert elastic_scope("main", SnapshotScope.ROOT, snapshot=True, checkpoints=False) is (
        SnapshotScope.ROOT
    )
