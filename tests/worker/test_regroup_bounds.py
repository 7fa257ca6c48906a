"""What a rank receiving a state over the wire allocates is bounded by its own model: a peer that
announces a longer structure, a shape the model does not have, a tensor where the model holds
none, or more bytes than the model could hold is refused, naming the peer, before anything is
allocated; the model's own state passes.

No process group: the peer is scripted in place of the collectives, and ``torch.empty`` is
watched, so "before anything is allocated" is what the test sees, not a memory reading.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from epochal.errors import EpochalError
from epochal.worker.regroup import wire
from epochal.worker.regroup.wire import STRUCTURE_FLOOR, Expects, broadcast_tree, encode

MODEL = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}

EXPECTS = Expects.of_model(
    MODEL,
    entries=(("model",),),
    optim=(("optim", "state"),),
    scalars=(("optim", "param_groups"), ("scaler",)),
)


class Peer:
    """Rank 0 as rank 1 sees it through the collectives: the length it announces, the structure,
    then its tensors."""

    def __init__(self, data: bytes, tensors: list[torch.Tensor], length: int | None = None):
        announced = len(data) if length is None else length
        self._frames = [
            torch.tensor([announced], dtype=torch.int64),
            torch.frombuffer(bytearray(data), dtype=torch.uint8),
        ]
        self._tensors = list(tensors)

    def get_rank(self) -> int:
        return 1

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None) -> None:
        tensor.copy_(self._frames.pop(0))

    def broadcast_tensors(self, moving: list[torch.Tensor], **kwargs: Any) -> None:
        for tensor in moving:
            tensor.copy_(self._tensors.pop(0))


@pytest.fixture
def allocations(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Every ``torch.empty`` the receiver calls: (shape, dtype)."""
    made: list[tuple[tuple[int, ...], torch.dtype]] = []
    empty = torch.empty

    def watched(*shape: Any, dtype: torch.dtype, device: Any = None) -> torch.Tensor:
        dims = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        made.append((tuple(int(n) for n in dims), dtype))
        return empty(*shape, dtype=dtype, device=device)

    monkeypatch.setattr(torch, "empty", watched)
    return made


def receive(monkeypatch: pytest.MonkeyPatch, peer: Peer, expects: Expects = EXPECTS) -> Any:
    monkeypatch.setattr(wire, "dist", peer)
    monkeypatch.setattr(wire, "broadcast_tensors", peer.broadcast_tensors)
    tree, _ = broadcast_tree(None, src=0, group=None, device=torch.device("cpu"), expects=expects)
    return tree


def forged(tree: Any) -> bytes:
    """A structure as a peer may write it, tensors described but never made."""
    return json.dumps(tree).encode()


def tensor(index: int, shape: list[int], dtype: str = "float32") -> dict[str, Any]:
    return {"tensor": [index, shape, dtype]}


def entries(**named: Any) -> dict[str, Any]:
    return {"dict": [[name, value] for name, value in named.items()]}


def test_the_model_s_own_state_passes_and_arrives_whole(monkeypatch, allocations):
    state = {
        "model": {"w": torch.randn(2, 3), "b": torch.randn(3)},
        "optim": {
            "state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, 3)}},
            "param_groups": [{"lr": 0.1, "params": ["w", "b"], "capturable_lr": torch.tensor(1)}],
        },
        "scaler": {"scale": 1024.0},
    }
    data, tensors = encode(state)
    got = receive(monkeypatch, Peer(data, tensors))
    assert torch.equal(got["model"]["w"], state["model"]["w"])
    assert torch.equal(
        got["optim"]["state"]["w"]["exp_avg"], state["optim"]["state"]["w"]["exp_avg"]
    )
    assert got["optim"]["param_groups"][0]["params"] == ["w", "b"]
    assert ((len(data),), torch.uint8) in allocations and ((2, 3), torch.float32) in allocations


def test_a_peer_announcing_a_huge_structure_is_refused_before_anything_is_allocated(
    monkeypatch, allocations
):
    with pytest.raises(EpochalError) as refused:
        receive(monkeypatch, Peer(b"{}", [], length=1 << 40))
    said = str(refused.value)
    assert said.startswith("rank 0 sent a state this rank's model cannot hold")
    assert f"a structure of {1 << 40} bytes, where this rank's model needs at most" in said
    assert EXPECTS.structure_bytes < STRUCTURE_FLOOR + 16 * 1024
    assert allocations == []


@pytest.mark.parametrize(
    ("structure", "said"),
    [
        (
            entries(model=entries(w=tensor(0, [100_000, 100_000]))),
            "model/w of shape [100000, 100000], where this rank's model has [2, 3]",
        ),
        (
            entries(model=entries(v=tensor(0, [2, 3]))),
            "a tensor model/v, an entry this rank's model does not have",
        ),
        (
            entries(optim=entries(state=entries(w=entries(exp_avg=tensor(0, [1 << 30]))))),
            "optimizer state optim/state/w/exp_avg of shape [1073741824] (1073741824 elements) "
            "for a parameter of 6",
        ),
        (
            entries(optim=entries(state=entries(x=entries(exp_avg=tensor(0, [2]))))),
            "optimizer state optim/state/x/exp_avg for a parameter this rank's model does not have",
        ),
        (
            entries(junk=tensor(0, [1 << 20])),
            "a tensor junk of shape [1048576], where this rank expects none",
        ),
        (
            entries(scaler=entries(scale=tensor(0, [1 << 20]))),
            "a tensor scaler/scale of shape [1048576], where this rank expects none",
        ),
    ],
)
def test_a_tensor_the_model_does_not_hold_is_refused_before_any_tensor_is_allocated(
    monkeypatch, allocations, structure, said
):
    data = forged(structure)
    with pytest.raises(EpochalError) as refused:
        receive(monkeypatch, Peer(data, []))
    assert str(refused.value).startswith("rank 0 sent a state this rank's model cannot hold")
    assert said in str(refused.value)
    assert allocations == [((len(data),), torch.uint8)]  # the structure, within its bound


def test_more_bytes_than_the_model_could_hold_are_refused(monkeypatch, allocations):
    big = {"w": torch.zeros(256, 256)}
    expects = Expects.of_model(big, optim=(("optim", "state"),))
    # each tensor the parameter's size, but more of them than any optimizer keeps
    states = {f"m{i}": tensor(i, [256, 256], "float64") for i in range(6)}
    data = forged(entries(optim=entries(state=entries(w=entries(**states)))))
    with pytest.raises(
        EpochalError, match=r"rank 0 .* 3145728 bytes of tensors, where this rank's"
    ):
        receive(monkeypatch, Peer(data, []), expects)
    assert allocations == [((len(data),), torch.uint8)]
