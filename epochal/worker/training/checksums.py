"""A checksum of a rank's weights, compared by the coordinator across ranks after each epoch.

:func:`weights_checksum` reads every parameter's bytes, in the module's order, as 64-bit words
and sums them twice on the parameter's own device: all the words, and every other one (so that
where a value sits counts too); the CRC-32 of those sums and of the bytes left over (fewer than 8 a
parameter) is the checksum. Ranks that hold the same model (DDP keeps the replicas bit-identical)
report the same value, and a single bit changed anywhere changes it; the coordinator aborts the run
naming the ranks that do not agree (:mod:`epochal.coordinator.rules.replicas`). A CRC-32 of every
byte took four times as long for a 3 MB model on one CPU core and twice as long for 100 MB, and
copied the weights to the host first on a GPU; these sums are two passes of one reduction each,
and only two numbers a parameter leave the device.
A parameter sharded across ranks (a DTensor: ``fully_sharded``) cannot be compared this way, and
the model then reports none.
"""

from __future__ import annotations

import zlib

import numpy
import torch

from epochal.worker.training.initialization import is_dtensor

WORD = 8
"""Bytes a word: the sums run over the parameters' bytes read as int64."""


def weights_checksum(model: torch.nn.Module, *, host: bool | None = None) -> int | None:
    """The checksum of ``model``'s parameters, or None when any is sharded across ranks.
    ``host``: sum with numpy (default: where the parameters are on the CPU) or with torch."""
    on_host: list[int] = []  # numpy's sums: a tenth of torch's cost a call on small parameters
    on_device: dict[torch.device, list[torch.Tensor]] = {}  # torch's, read off once a device
    leftovers: dict[torch.device, list[torch.Tensor]] = {}  # a model placed across devices
    with torch.no_grad():
        for param in model.parameters():
            if is_dtensor(param):
                return None
            data = param.detach().contiguous().reshape(-1).view(torch.uint8)
            if data.storage_offset() % WORD:  # words start on a word: a view of a flat buffer
                data = data.clone()
            whole = data.numel() - data.numel() % WORD
            # integer sums, wrapping: the same in any order, on any device
            if host if host is not None else data.device.type == "cpu":
                words = data.numpy()[:whole].view(numpy.int64)
                on_host += (int(words.sum()), int(words[::2].sum()))
            else:
                device_words = data[:whole].view(torch.int64)
                on_device.setdefault(data.device, []).extend(
                    (device_words.sum(), device_words[::2].sum())
                )
            leftovers.setdefault(data.device, []).append(data[whole:])
    numbers = on_host + [n for sums in on_device.values() for n in torch.stack(sums).tolist()]
    crc = zlib.crc32(numpy.array(numbers, dtype="<i8").tobytes())
    for parts in leftovers.values():
        crc = zlib.crc32(torch.cat(parts).cpu().numpy().tobytes(), crc)
    return crc
