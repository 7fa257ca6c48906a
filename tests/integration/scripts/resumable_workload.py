"""The workload of the resume tests and of the elastic bench, defined once.

``resumable.py`` trains it under epochal; ``torchrun_resumable.py`` (the elastic bench's torchrun
column) trains it as a torchrun script: the same rows, model, optimizer and loaders, so that the
two columns cannot drift apart.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def workload() -> tuple[torch.Tensor, torch.Tensor, nn.Module, torch.optim.Optimizer]:
    """256 seeded rows of 16 features and their labels; the model (dropout in it) and its SGD
    with momentum, both seeded."""
    torch.manual_seed(7)
    g = torch.Generator().manual_seed(99)
    x = torch.randn(256, 16, generator=g)
    y = (x[:, :4].sum(dim=1) > 0).long()
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return x, y, model, optimizer


def train_loader(x: torch.Tensor, y: torch.Tensor, rank: int, world: int) -> DataLoader:
    """Rank ``rank``'s rows of ``world``, shuffled by torch's global generator."""
    return DataLoader(TensorDataset(x[rank::world], y[rank::world]), batch_size=8, shuffle=True)


def valid_loader(x: torch.Tensor, y: torch.Tensor, rank: int, world: int) -> DataLoader:
    """The first 32 of rank ``rank``'s rows, in order."""
    return DataLoader(TensorDataset(x[rank::world][:32], y[rank::world][:32]), batch_size=16)
