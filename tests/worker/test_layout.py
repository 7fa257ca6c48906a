"""The layout every mode is built from: what it refuses, what wrap reads into it, and that no
strategy asks torch.distributed for its place or keeps one of its own.

A strategy built again for another process group (another world size) must find everything about
its world in the :class:`Layout` it is given; these tests hold the modes to that, in one process
(a one-rank gloo group where a real group is needed).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import epochal.worker.strategies as strategies
from epochal.errors import ConfigError
from epochal.worker.strategies import MODES, STRATEGIES, Layout, Strategy, wrap
from epochal.worker.training.placement import LayeredModel

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"rank": 2, "world_size": 2}, r"rank 2 is outside a world of 2 rank\(s\) \(0 to 1\)"),
        ({"rank": -1, "world_size": 2}, r"rank -1 is outside a world of 2"),
        ({"rank": 0, "world_size": 0}, r"at least 1 rank, got world_size=0"),
        ({"rank": True, "world_size": 2}, r"rank True is outside"),
        ({"root": 3}, r"the default group's rank 0 is global rank 0, got root=3"),
        ({"root": -2}, r"the root is a global rank >= 0, got -2"),
        ({"device": "cpu"}, r"a layout's device is a torch.device, got 'cpu'"),
    ],
)
def test_a_layout_refuses_a_place_no_rank_can_hold(fields: dict[str, Any], message: str) -> None:
    given = {"device": CPU, "group": None, "rank": 0, "world_size": 1, "root": 0, **fields}
    with pytest.raises(ConfigError, match=message):
        Layout(**given)


def test_a_layout_is_frozen_and_says_who_is_root() -> None:
    layout = Layout(device=CPU, group=None, rank=1, world_size=3, root=0)
    assert (
        not layout.is_root and Layout(device=CPU, group=None, rank=0, world_size=3, root=0).is_root
    )
    with pytest.raises(AttributeError):
        layout.world_size = 2  # type: ignore[misc]


def test_a_layout_needs_a_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match="join the run first"):
        Layout.from_group(CPU)


@pytest.fixture
def one_rank(tmp_path: Path) -> Any:
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "s"), 1), rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def spy_on_builds(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Layout]]:
    """Record the layout each mode's build receives (and build it as before)."""
    seen: list[tuple[str, Layout]] = []
    for cls in STRATEGIES.values():
        real = cls.build  # bound to cls

        def build(cls: type[Strategy], *args: Any, _real: Any = real, **kwargs: Any) -> Strategy:
            layout = kwargs.get("layout", args[2] if len(args) > 2 else None)
            assert isinstance(layout, Layout)
            seen.append((cls.mode.value, layout))
            return _real(*args, **kwargs)  # type: ignore[no-any-return]

        monkeypatch.setattr(cls, "build", classmethod(build))
    return seen


def test_every_mode_is_built_from_the_layout_wrap_reads_and_keeps_it(one_rank, monkeypatch):
    seen = spy_on_builds(monkeypatch)
    whole = Layout(device=CPU, group=None, rank=0, world_size=1, root=0, placed=False)
    built: dict[str, Strategy] = {}
    for mode in MODES:
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
        built[mode] = wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), CPU, mode=mode)
    assert [m for m, _ in seen] == list(MODES)
    for mode, layout in seen:
        assert layout == whole, mode
        assert built[mode].layout is layout, mode  # the strategy reads the one it was built from

    sub = dist.new_group([0])
    model = nn.Linear(3, 1)
    s = wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), CPU, mode="main", group=sub)
    assert s.layout == Layout(device=CPU, group=sub, rank=0, world_size=1, root=0)
    assert s.layout.group is sub

    layered = LayeredModel.build(
        lambda: nn.Linear(3, 4), [lambda: nn.Linear(4, 1)], nn.Tanh, devices=["cpu", "cpu"]
    )
    s = wrap(layered, torch.optim.SGD(layered.parameters(), lr=0.1), CPU)
    assert s.layout.placed and not built["replicated"].layout.placed


def test_every_mode_takes_the_model_the_optimizer_a_layout_and_its_options_alone() -> None:
    for mode, cls in STRATEGIES.items():
        names = list(inspect.signature(cls.build).parameters)
        assert names == ["model", "optimizer", "layout", "opts", "ddp_options"], mode


# what a strategy would ask torch.distributed to learn its place in the world
PLACE_QUERIES = {
    "get_rank",
    "get_world_size",
    "get_global_rank",
    "get_group_rank",
    "get_process_group_ranks",
    "get_node_local_rank",
}


def test_no_strategy_asks_torch_distributed_for_its_place_but_the_layout() -> None:
    package = Path(strategies.__file__).parent
    asked = []
    for path in sorted(package.glob("*.py")):
        if path.name == "layout.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
            if name in PLACE_QUERIES:
                asked.append(f"{path.name}:{node.lineno} {name}")  # type: ignore[attr-defined]
    assert asked == [], f"read the rank and world size from the strategy's layout: {asked}"
