"""A checksum of a rank's weights, compared by the coordinator across ranks after each epoch.

:func:`weights_checksum` is the CRC-32 of every parameter's bytes, in the module's order. Ranks
that hold the same model (DDP keeps the replicas bit-identical) report the same value; the
coordinator aborts the run naming the ranks that do not (:mod:`epochal.coordinator.rules.replicas`).
A parameter sharded across ranks (a DTensor: ``fully_sharded``) cannot be compared this way, and
the model then reports none. On a GPU the parameters are copied to the host first, once an epoch.
"""

from __future__ import annotations

import zlib

import torch

from epochal.worker.training.initialization import is_dtensor


def weights_checksum(model: torch.nn.Module) -> int | None:
    """CRC-32 of ``model``'s parameters, or None when any is sharded across ranks."""
    crc = 0
    with torch.no_grad():
        for param in model.parameters():
            if is_dtensor(param):
                return None
            data = param.detach()
            if data.device.type != "cpu":
                data = data.cpu()
            data = data.contiguous().reshape(-1).view(torch.uint8)
            crc = zlib.crc32(data.numpy().data, crc)
    return crc
