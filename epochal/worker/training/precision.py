"""Mixed precision and gradient-norm clipping: what happens around the forward and at a step.

``train(..., precision=..., clip_grad_norm=...)`` builds one :class:`StepPolicy`, which the
strategy (:mod:`epochal.worker.strategies`) holds and the training loop uses:

- ``precision="32"`` (the default): plain float32, nothing added.
- ``precision="bf16"``: the forward and the loss run under ``torch.autocast`` with bfloat16 (CPU
  and CUDA). Parameters, gradients and optimizer state stay float32; bfloat16 has float32's
  exponent range, so gradients need no scaling.
- ``precision="fp16"``: autocast with float16, and a ``torch.amp.GradScaler`` on the same device
  type. float16's range is what needs the scaler, not the device: small gradients underflow to
  zero on CPU as on CUDA, so CPU autocast's float16 gets a CPU scaler too. A torch whose CPU
  autocast lacks float16 warns and runs float32; here that is a ConfigError instead.
  The loss is multiplied by the scale before backward; at a step the gradients are unscaled, and
  a step whose gradients hold an inf or NaN is skipped and the scale halved (the scale doubles
  after 2000 clean steps).

``clip_grad_norm=X`` rescales the gradients at each step so that their global L2 norm, over
every parameter the optimizer steps, is at most X (``torch.nn.utils.clip_grad_norm_``). It runs
in :meth:`StepPolicy.step`, so only on the batch that steps, once accumulation is complete, after
the gradients were averaged across ranks and, with ``fp16``, unscaled. In every mode the norm is
the whole model's: replicated and sharded hold the averaged full gradients on every rank (DDP's
all-reduce; ZeRO shards only the optimizer state), main clips on rank 0 after the reduction, and
fully_sharded's gradients are DTensor shards, whose norm ``clip_grad_norm_`` reduces across ranks.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist

from epochal.errors import ConfigError
from epochal.worker.checkpoints.state import Stateful, whole_on_root

SCALER_KEY = "grad_scaler"  # the loss scaler's entry in a checkpoint's state (fp16)


class Precision(StrEnum):
    """The precisions ``train(..., precision=...)`` takes (the plain strings work too)."""

    FP32 = "32"
    BF16 = "bf16"
    FP16 = "fp16"


PRECISIONS: tuple[str, ...] = tuple(p.value for p in Precision)

_AUTOCAST_DTYPES = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}


def check_precision(value: object) -> Precision:
    """``value`` as a :class:`Precision`; anything else is refused with the accepted ones."""
    if isinstance(value, str):
        try:
            return Precision(value)
        except ValueError:
            pass
    accepted = ", ".join(repr(p) for p in PRECISIONS)
    raise ConfigError(f"unknown precision {value!r}: pick one of {accepted} (strings)")


def check_clip_grad_norm(value: object) -> float | None:
    """``value`` as a float > 0, or None (no clipping); anything else is refused."""
    if value is None:
        return None
    if (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    ):
        return float(value)
    raise ConfigError(
        f"clip_grad_norm must be a finite number > 0 (the largest global L2 norm the gradients "
        f"may have at a step) or None for no clipping, got {value!r}"
    )


def _check_autocast(device_type: str, dtype: torch.dtype) -> None:
    """Refuse an autocast torch would quietly disable (it warns) or cannot run here."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # torch warns, then disables it
            with torch.autocast(device_type, dtype=dtype):
                pass
    except (UserWarning, RuntimeError) as exc:
        raise ConfigError(
            f"autocast to {dtype} is not available on {device_type} with torch "
            f"{torch.__version__}: {exc}"
        ) from None


class StepPolicy:
    """Autocast, loss scaling and gradient clipping of one run, on one device type.

    The default (``"32"``, no clipping) adds nothing: the loop's forward, backward and
    ``optimizer.step()`` run as written.
    """

    def __init__(
        self,
        precision: str = Precision.FP32,
        clip_grad_norm: float | None = None,
        device_type: str = "cpu",
    ) -> None:
        self.precision = check_precision(precision)
        self.clip_grad_norm = check_clip_grad_norm(clip_grad_norm)
        self.device_type = device_type
        self._dtype = _AUTOCAST_DTYPES.get(self.precision)
        if self._dtype is not None:
            _check_autocast(device_type, self._dtype)
        self.scaler: torch.amp.GradScaler | None = (
            torch.amp.GradScaler(device_type) if self.precision is Precision.FP16 else None
        )

    def autocast(self) -> AbstractContextManager[Any]:
        """Around the forward and the loss (training and validation)."""
        if self._dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self._dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, the loss multiplied by the scale first with ``fp16``."""
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()  # type: ignore[no-untyped-call]

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale (fp16), clip, and step ``optimizer`` over its gradients, already combined
        across ranks the way the mode combines them. With fp16 a step whose gradients hold an
        inf or NaN is skipped and the scale lowered, on every rank alike: the DDP modes' ranks
        hold the same gradients, and an inf in one rank's FSDP2 shard is reduced to all."""
        scaler = self.scaler
        if scaler is not None and self.clip_grad_norm is not None:
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        if self.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(_parameters(optimizer), self.clip_grad_norm)
        if scaler is None:
            optimizer.step()
            return
        scaler.step(optimizer)
        scaler.update()

    def share_scale(self, src: int, group: dist.ProcessGroup | None, device: torch.device) -> None:
        """Collective, fp16 only: every rank takes ``src``'s scaler state (mode main, where rank
        0 alone steps and so alone learns whether a step overflowed). ``device``: where the
        process group's backend communicates (a parameter's device)."""
        scaler = self.scaler
        if scaler is None:
            return
        mine = scaler.state_dict()
        values = [mine["scale"], mine["_growth_tracker"]]
        shared = torch.tensor(values, dtype=torch.float64, device=device)
        dist.broadcast(shared, src=src, group=group)
        if dist.get_rank() != src:
            scale, tracker = shared.tolist()
            scaler.load_state_dict({**mine, "scale": scale, "_growth_tracker": int(tracker)})

    def checkpointed(self, state: Stateful) -> Stateful:
        """``state``, with the scaler's state beside it under :data:`SCALER_KEY` (fp16)."""
        return state if self.scaler is None else ScaledState(state, self.scaler)


class ScaledState:
    """A checkpoint's state and the loss scaler's (its scale and count of clean steps), so that
    a resumed fp16 run does not start over from the initial scale and skip steps the
    uninterrupted run did not. Every rank's scaler is the same, so any rank's copy serves."""

    def __init__(self, inner: Stateful, scaler: torch.amp.GradScaler) -> None:
        self.inner = inner
        self.scaler = scaler

    @property
    def whole_on_root(self) -> bool:
        """Whole on rank 0 where ``inner`` is: the scaler's state is the same on every rank."""
        return whole_on_root(self.inner)

    def state_dict(self) -> dict[str, Any]:
        return {**self.inner.state_dict(), SCALER_KEY: self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.scaler.load_state_dict(state.pop(SCALER_KEY))
        self.inner.load_state_dict(state)


def _parameters(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]
