"""Layer placement: a model of input, hidden and output layers spread over a worker's devices.

Burn's ``DistributedLayeredModel``, for a model larger than one device: the model is described as
an input layer, hidden layers and an output layer, and each layer lives on one of the worker's
local devices. :class:`LayeredModel` holds the layers with their placement, checks that every
layer was built where it is placed (a layer built on the wrong device would otherwise be copied
at every forward, or fail deep inside autograd), and moves the activations from device to device
in the forward; autograd moves the gradients back, so every layer gets its gradient.

The placement is either given (one device per layer, or a mapping from layer name to device) or
planned: :func:`even_split` gives the devices equal numbers of consecutive layers;
:func:`memory_split` gives each device a share of the layers' bytes weighted by its free memory.
:meth:`LayeredModel.build` plans and builds each layer directly on its device, so no device ever
holds the whole model.

Placement composes with data parallelism across workers: every worker holds the same layered
model over its own devices, and :func:`epochal.worker.strategies.wrap` leaves it where it is and
wraps it in DDP without ``device_ids`` (modes replicated, main and sharded).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from epochal.errors import ConfigError

DeviceLike = torch.device | str | int
LayerFactory = Callable[[], nn.Module]


def local_devices() -> list[torch.device]:
    """This worker's devices: every CUDA device it sees, else the CPU."""
    if torch.cuda.is_available():
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")]


def normalize(device: DeviceLike) -> torch.device:
    """``device`` as tensors on it report it (``cuda`` gets the current index, ``cpu`` none)."""
    d = torch.device(device)
    if d.type == "cpu":
        return torch.device("cpu")
    if d.index is None and d.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return d


def free_memory(device: DeviceLike) -> int:
    """Bytes free on ``device`` now: CUDA's free memory, or the host's available memory."""
    d = normalize(device)
    if d.type == "cuda":
        return int(torch.cuda.mem_get_info(d)[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def even_split(layers: int, devices: Sequence[DeviceLike]) -> tuple[torch.device, ...]:
    """Consecutive layers, the same number (give or take one) on each device, in order."""
    if layers < 1 or not devices:
        raise ConfigError(f"cannot place {layers} layer(s) on {len(devices)} device(s)")
    per, extra = divmod(layers, len(devices))
    out: list[torch.device] = []
    for i, device in enumerate(devices):
        out += [normalize(device)] * (per + (1 if i < extra else 0))
    return tuple(out)


def memory_split(
    layer_bytes: Sequence[int],
    devices: Sequence[DeviceLike],
    free_bytes: Sequence[int] | None = None,
) -> tuple[torch.device, ...]:
    """Consecutive layers, each device's share of the bytes weighted by its free memory.

    ``layer_bytes`` are the sizes of the layers in order; ``free_bytes`` the devices' free memory
    (default: measured now with :func:`free_memory`). A layer goes to the device whose share
    holds the middle of the layer, so the layers stay in order and each device's bytes are as
    close to its share as whole layers allow. Refused when the layers need more than is free.
    """
    if not layer_bytes or not devices:
        raise ConfigError(f"cannot place {len(layer_bytes)} layer(s) on {len(devices)} device(s)")
    free = [free_memory(d) for d in devices] if free_bytes is None else list(free_bytes)
    if len(free) != len(devices) or any(f < 0 for f in free) or sum(free) <= 0:
        raise ConfigError(
            f"free memory {free} does not fit devices {list(devices)}: give one number >= 0 per "
            "device, not all zero"
        )
    total = sum(layer_bytes)
    if total > sum(free):
        raise ConfigError(
            f"the layers take {total} bytes but the devices have {sum(free)} bytes free: add "
            "devices, shrink the model, or shard it (mode fully_sharded)"
        )
    bounds, acc = [], 0.0
    for f in free:
        acc += f / sum(free)
        bounds.append(acc)
    out: list[torch.device] = []
    done = 0
    for size in layer_bytes:
        middle = (done + size / 2) / total if total else (len(out) + 0.5) / len(layer_bytes)
        done += size
        i = next((k for k, b in enumerate(bounds) if middle < b), len(devices) - 1)
        out.append(normalize(devices[i]))
    return tuple(out)


def _layer_names(hidden: int) -> list[str]:
    return ["input", *(f"hidden.{i}" for i in range(hidden)), "output"]


def _on(t: torch.Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def _move(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, tuple | list):
        return type(value)(_move(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _move(v, device) for k, v in value.items()}
    return value


class LayeredModel(nn.Module):
    """Input, hidden and output layers, each on its own device, run in that order.

    ``placement`` gives each layer's device: a sequence in layer order (input, hidden..., output)
    or a mapping from layer name (``"input"``, ``"hidden.0"``, ..., ``"output"``) to device. Every
    layer must already be on its device (build it there: :meth:`build` does); a placement that
    misses a layer, or a layer built elsewhere, is refused naming it. The forward moves each
    layer's input to the layer's device, and the result to ``output_device`` when one is given
    (e.g. where the targets are), else leaves it on the output layer's device.
    """

    def __init__(
        self,
        input_layer: nn.Module,
        hidden: Sequence[nn.Module],
        output_layer: nn.Module,
        placement: Sequence[DeviceLike] | Mapping[str, DeviceLike],
        *,
        output_device: DeviceLike | None = None,
    ) -> None:
        super().__init__()
        names = _layer_names(len(hidden))
        layers = [input_layer, *hidden, output_layer]
        if isinstance(placement, Mapping):
            missing = [n for n in names if n not in placement]
            unknown = [str(n) for n in placement if n not in names]
            if missing or unknown:
                raise ConfigError(
                    "the placement does not cover the model's layers"
                    + (f"; no device for {', '.join(missing)}" if missing else "")
                    + (f"; no layer named {', '.join(unknown)}" if unknown else "")
                    + f": the layers are {', '.join(names)}"
                )
            devices = [normalize(placement[n]) for n in names]
        else:
            if len(placement) != len(layers):
                uncovered = names[len(placement) :]
                raise ConfigError(
                    f"the placement gives {len(placement)} device(s) for {len(layers)} layers "
                    f"({', '.join(names)})"
                    + (f"; no device for {', '.join(uncovered)}" if uncovered else "")
                    + ": give exactly one device per layer, in that order"
                )
            devices = [normalize(d) for d in placement]
        for name, layer, device in zip(names, layers, devices, strict=True):
            for tname, t in [*layer.named_parameters(), *layer.named_buffers()]:
                if not _on(t, device):
                    raise ConfigError(
                        f"layer {name!r} is placed on {device} but its {tname!r} was built on "
                        f"{t.device}: build each layer on its device (LayeredModel.build does, "
                        "or create it under `with torch.device(...)`), or place it where it is"
                    )
        self.input = input_layer
        self.hidden = nn.ModuleList(hidden)
        self.output = output_layer
        self.placement = tuple(devices)
        # the device of each layer, in order: input, hidden..., output
        self.output_device = None if output_device is None else normalize(output_device)

    @property
    def devices(self) -> tuple[torch.device, ...]:
        """The distinct devices the layers are on, in layer order."""
        return tuple(dict.fromkeys(self.placement))

    def layers(self) -> list[nn.Module]:
        return [self.input, *self.hidden, self.output]

    def forward(self, x: Any) -> Any:
        for layer, device in zip(self.layers(), self.placement, strict=True):
            x = layer(_move(x, device))
        return x if self.output_device is None else _move(x, self.output_device)

    @classmethod
    def build(
        cls,
        input_layer: LayerFactory,
        hidden: Sequence[LayerFactory],
        output_layer: LayerFactory,
        *,
        devices: Sequence[DeviceLike] | None = None,
        split: str = "even",
        free_bytes: Sequence[int] | None = None,
        output_device: DeviceLike | None = None,
    ) -> LayeredModel:
        """Plan a placement over ``devices`` (default: :func:`local_devices`) and build each layer
        on its device by calling its factory there.

        ``split`` is ``"even"`` (:func:`even_split`) or ``"memory"`` (:func:`memory_split`, with
        each layer's size measured by building it on the meta device first, which allocates
        nothing and leaves the random-number generators untouched).
        """
        factories = [input_layer, *hidden, output_layer]
        targets = local_devices() if devices is None else list(devices)
        if split == "even":
            placement = even_split(len(factories), targets)
        elif split == "memory":
            sizes = []
            with torch.random.fork_rng(devices=[]):
                for factory in factories:
                    with torch.device("meta"):
                        probe = factory()
                    sizes.append(
                        sum(
                            t.numel() * t.element_size()
                            for t in [*probe.parameters(), *probe.buffers()]
                        )
                    )
            placement = memory_split(sizes, targets, free_bytes)
        else:
            raise ConfigError(f"unknown split {split!r}: use 'even' or 'memory'")
        layers = []
        for factory, device in zip(factories, placement, strict=True):
            with device:
                layers.append(factory())
        return cls(layers[0], layers[1:-1], layers[-1], placement, output_device=output_device)
