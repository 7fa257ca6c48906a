"""Worker pieces that need no coordinator: fingerprints, addresses, argument checks."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

import epochal
from epochal.errors import ConfigError
from epochal.worker.fingerprint import describe, fingerprint
from epochal.worker.joinoptions import advertised_host
from epochal.worker.strategies.strategy import copy_state


def test_fingerprint_is_stable_and_sees_shapes_dtypes_and_buffers():
    a = fingerprint(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)))
    b = fingerprint(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)))
    assert a == b  # values do not matter, only names, shapes and dtypes
    described = describe(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)))
    assert described.fingerprint == a
    names = [p.name for p in described.params]
    assert "1.running_mean" in names and "0.weight" in names
    assert a.entries == len(described.params)
    assert fingerprint(nn.Sequential(nn.Linear(4, 2), nn.BatchNorm1d(2))).digest != a.digest
    assert (
        fingerprint(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).double()).digest != a.digest
    )
    assert a.torch_version == torch.__version__


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("127.0.0.1:5555", "is not a ZeroMQ endpoint"),
        ("http://127.0.0.1:5555", "is not a ZeroMQ endpoint"),
        ("tcp://127.0.0.1", "has no port"),
        ("tcp://127.0.0.1:0", "has no port"),
    ],
)
def test_bad_coordinator_addresses_are_refused_before_connecting(address, message):
    with pytest.raises(ConfigError, match=message):
        epochal.join(nn.Linear(2, 2), coordinator=address)


def test_no_coordinator_at_all_says_how_to_give_one(monkeypatch):
    monkeypatch.delenv("EPOCHAL_COORDINATOR", raising=False)
    with pytest.raises(ConfigError, match="set EPOCHAL_COORDINATOR"):
        epochal.join(nn.Linear(2, 2))


def test_bad_job_name_and_timeouts_are_refused(monkeypatch):
    with pytest.raises(ConfigError, match="job name 'no spaces' is not allowed"):
        epochal.join(nn.Linear(2, 2), coordinator="tcp://127.0.0.1:1", job="no spaces")
    monkeypatch.setenv("EPOCHAL_CONNECT_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="EPOCHAL_CONNECT_TIMEOUT='soon' is not a number"):
        epochal.join(nn.Linear(2, 2), coordinator="tcp://127.0.0.1:1")


def test_advertised_host(monkeypatch):
    monkeypatch.delenv("EPOCHAL_HOST", raising=False)
    assert advertised_host("tcp://127.0.0.1:4000") == "127.0.0.1"
    assert advertised_host("tcp://localhost:4000") == "127.0.0.1"
    assert advertised_host("ipc:///tmp/x.sock") == "127.0.0.1"
    monkeypatch.setenv("EPOCHAL_HOST", "10.1.2.3")
    assert advertised_host("tcp://127.0.0.1:4000") == "10.1.2.3"


def test_the_digest_covers_a_name_too_long_for_a_page_whole():
    class Named(nn.Module):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.register_buffer(name, torch.zeros(1))

    long_a, long_b = "a" * 2000, "a" * 1999 + "b"
    a, b = describe(Named(long_a)), describe(Named(long_b))
    assert a.fingerprint.digest != b.fingerprint.digest
    assert len(a.params[0].name) == len(b.params[0].name) == 1024  # cut alike in the pages


def test_a_best_epoch_s_copy_reuses_the_last_one_s_tensors_where_they_fit() -> None:
    """The copy is the state's at the moment (the model changing after it does not change it);
    the next copy is written into the same tensors; a state of other shapes gets new ones."""
    model = nn.Linear(3, 2)
    first = copy_state(model.state_dict(), None)
    with torch.no_grad():
        model.weight.add_(1.0)
    assert not torch.equal(first["weight"], model.weight)  # a copy, not a view
    kept = first["weight"]
    second = copy_state(model.state_dict(), first)
    assert second is first and second["weight"] is kept
    assert all(torch.equal(second[k], v) for k, v in model.state_dict().items())
    other = copy_state(nn.Linear(4, 2).state_dict(), second)
    assert other is not second and other["weight"].shape == (2, 4)
    assert second["weight"].shape == (2, 3)  # the old copy left as it was


@pytest.mark.parametrize(("world", "fresh"), [(1, False), (2, False), (3, True), (8, True)])
def test_an_epoch_starts_with_a_fresh_reducer_only_where_the_layout_can_change_a_sum(
    world: int, fresh: bool
) -> None:
    """Two ranks' sum is one addition, the same bits in any bucket layout: the reducer is kept.
    From three ranks on the order of additions follows the layout: a fresh reducer every epoch
    makes a resumed epoch start as the uninterrupted one did."""
    from epochal.worker.strategies.layout import Layout
    from epochal.worker.strategies.replicated import Replicated

    model = nn.Linear(2, 1)
    layout = Layout(device=torch.device("cpu"), group=None, rank=0, world_size=world, root=0)
    strategy = Replicated(model, torch.optim.SGD(model.parameters(), lr=0.1), model, layout)
    built: list[nn.Module] = []

    def fresh_ddp() -> nn.Module:  # stands in for a DDP wrapper built over the layout's group
        built.append(nn.Identity())
        return built[-1]

    configured: list[nn.Module] = []
    strategy.ddp = kept = nn.Identity()  # type: ignore[assignment]  # the wrapper built first
    strategy._fresh_ddp = fresh_ddp  # type: ignore[assignment]
    strategy.configure = configured.append
    for _ in range(3):
        strategy.begin_epoch()
    assert len(built) == (3 if fresh else 0)
    assert strategy.ddp is (built[-1] if fresh else kept)
    # configure_ddp's hook goes on every wrapper that trains, once: a comm hook registers once
    assert configured == (built if fresh else [kept])
    # leaving the group drops the wrapper, kept or fresh: it holds the process group
    last = weakref.ref(strategy.ddp)  # type: ignore[arg-type]
    strategy.release_group()
    del kept
    built.clear()
    configured.clear()
    assert last() is None, "the strategy still holds its last DDP wrapper, and so its group"
