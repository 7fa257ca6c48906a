"""A map-style dataset that notes every sample it loads, for the tests that a positioned loader
loads nothing before its position (tests/worker/test_passes.py, test_positioning.py)."""

from __future__ import annotations

import os
from pathlib import Path

from torch.utils.data import Dataset


class Recorded(Dataset[int]):
    """Sample ``i`` is ``i``; every ``__getitem__`` is noted in a file of the loading process,
    so the loads in a DataLoader's worker processes are seen too."""

    def __init__(self, samples: int, log_dir: Path) -> None:
        self.samples = samples
        self.log_dir = log_dir

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> int:
        with open(self.log_dir / f"{os.getpid()}.log", "a") as log:
            log.write(f"{index}\n")
        return index

    def loaded(self) -> list[int]:
        """Every index loaded so far, by any process."""
        return [int(x) for p in self.log_dir.glob("*.log") for x in p.read_text().split()]

    def forget(self) -> None:
        """Start the record afresh."""
        for p in self.log_dir.glob("*.log"):
            p.unlink()
