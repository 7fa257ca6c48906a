"""What leaving a process group relies on in torch (:mod:`epochal.worker.dataplane.torchinternals`)
is still there, and does what it is for: after :func:`~epochal.worker.regroup.leave`, in every
mode, nothing in the process holds the group any more (its sockets then close, and a peer blocked
in a collective with this rank raises at once). Run with each torch release the project supports:
a release that moves one of these fails here, naming it.
"""

from __future__ import annotations

import gc
import sys
import types
import weakref
from pathlib import Path

import pytest
import torch.distributed as dist

from epochal.worker.dataplane import torchinternals
from epochal.worker.regroup import leave
from epochal.worker.strategies import wrap
from tests.worker.elastic import (
    CPU,
    form_group,
    load,
    make_model,
    make_optimizer,
    save,
    spawn,
    train_epoch,
)
from tests.worker.ranks import RANKS

MODES = ("replicated", "main", "sharded", "fully_sharded")


def test_torch_still_offers_what_leaving_a_group_relies_on():
    assert torchinternals.changed() == []


def _defaults_holding(group: dist.ProcessGroup) -> list[str]:
    """Every function of a loaded ``torch.distributed`` module whose default arguments hold
    ``group``, by name."""
    found = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("torch.distributed") or not isinstance(module, types.ModuleType):
            continue
        for value in list(vars(module).values()):
            candidates = [value, *(vars(value).values() if isinstance(value, type) else ())]
            for fn in candidates:
                if isinstance(fn, staticmethod | classmethod):
                    fn = fn.__func__
                if not isinstance(fn, types.FunctionType):
                    continue
                held = [*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()]
                if any(d is group for d in held):
                    found.append(f"{name}.{fn.__qualname__}")
    return found


def one_rank(index: int, tmp: Path) -> None:
    out = {}
    for generation, mode in enumerate(MODES):
        form_group(tmp, generation, 0, 1)
        group = dist.group.WORLD
        assert group is not None
        model = make_model(1)
        strategy = wrap(model, make_optimizer(model), CPU, mode=mode)
        train_epoch(strategy, 0, 0, 1)
        defaults = _defaults_holding(group)
        alive = weakref.ref(group)
        del group
        leave(strategy)
        out[mode] = {"defaults": defaults, "group_alive": alive() is not None}
    save(tmp, "left", out)


@pytest.mark.slow
@RANKS
@pytest.mark.timeout(300)
def test_after_leaving_nothing_holds_the_group_in_any_mode(tmp_path):
    spawn(one_rank, 1, tmp_path, deadline=240)
    for mode, got in load(tmp_path, "left").items():
        assert got["defaults"] == [], (
            f"mode {mode}: torch functions hold the group as a default argument: "
            f"{got['defaults']}; add their modules to torchinternals.IMPORT_BEFORE_ANY_GROUP"
        )
        assert not got["group_alive"], (
            f"mode {mode}: the process group outlived leave(); something in torch keeps it "
            "(a device mesh in DTensor's caches? see torchinternals.release_mesh)"
        )


def test_a_released_mesh_holds_its_groups_names_only(tmp_path):
    from torch.distributed.device_mesh import DeviceMesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        assert group is not None
        mesh = DeviceMesh.from_group(group, "cpu")
        held = getattr(mesh, torchinternals.MESH_GROUPS)
        assert group in held.values()  # what release_mesh must drop is where it looks
        torchinternals.release_mesh(mesh)
        for name, value in vars(mesh).items():
            inside = value.values() if isinstance(value, dict) else value
            assert not (
                isinstance(inside, list | tuple | type({}.values()))
                and any(v is group for v in inside)
            ), f"DeviceMesh.{name} still holds the group after release_mesh"
    finally:
        dist.destroy_process_group()
        gc.collect()
