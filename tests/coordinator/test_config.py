"""CoordinatorConfig refuses every out-of-range value with a ConfigError that names it."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest

from epochal.coordinator.config import BACKEND_CHOICES, BATCH_POLICIES, CoordinatorConfig
from epochal.errors import ConfigError, EpochalError
from epochal.protocol.messages import DEFAULT_JOB

TIMEOUTS = [
    "rendezvous_timeout",
    "store_timeout",
    "heartbeat_interval",
    "heartbeat_timeout",
    "finish_timeout",
]


def refusal(**fields: Any) -> str:
    fields.setdefault("world_size", 2)
    with pytest.raises(ConfigError) as info:
        CoordinatorConfig(**fields)
    return str(info.value)


def test_defaults_are_valid_and_documented_values():
    cfg = CoordinatorConfig(world_size=1)
    assert cfg.epochs == 10
    assert cfg.job == DEFAULT_JOB
    assert cfg.token == ""
    assert cfg.batch_policy == "error"
    assert cfg.smoothing == 1.0
    assert cfg.backend == "auto"
    assert cfg.run_dir is None
    assert cfg.heartbeat_timeout > cfg.heartbeat_interval > 0
    for name in TIMEOUTS:
        value = getattr(cfg, name)
        assert value > 0 and math.isfinite(value), name


def test_a_config_error_is_also_a_value_error_and_an_epochal_error():
    assert issubclass(ConfigError, ValueError)
    assert issubclass(ConfigError, EpochalError)
    with pytest.raises(ValueError):
        CoordinatorConfig(world_size=0)


def test_the_config_is_frozen_and_keyword_only():
    cfg = CoordinatorConfig(world_size=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.world_size = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        CoordinatorConfig(2)  # type: ignore[misc]


def test_every_valid_choice_is_accepted():
    for policy in BATCH_POLICIES:
        assert CoordinatorConfig(world_size=1, batch_policy=policy).batch_policy == policy
    for backend in BACKEND_CHOICES:
        assert CoordinatorConfig(world_size=1, backend=backend).backend == backend
    cfg = CoordinatorConfig(
        world_size=1000,
        epochs=1,
        job="exp-7.b_2",
        token="t",
        smoothing=1e-6,
        run_dir=Path("runs"),
        rendezvous_timeout=0.5,
        store_timeout=1e-3,
        heartbeat_interval=0.1,
        heartbeat_timeout=0.2,
        finish_timeout=1e9,
    )
    assert cfg.smoothing == 1e-6 and cfg.world_size == 1000


@pytest.mark.parametrize("world_size", [0, -1])
def test_world_size_below_one_is_refused(world_size: int):
    assert refusal(world_size=world_size) == f"world size must be >= 1, got {world_size}"


@pytest.mark.parametrize("epochs", [0, -3])
def test_epochs_below_one_are_refused(epochs: int):
    assert refusal(epochs=epochs) == f"epochs must be >= 1, got {epochs}"


@pytest.mark.parametrize("smoothing", [0.0, -0.5, 1.5, 1.0000001, math.nan, math.inf, -math.inf])
def test_smoothing_outside_zero_to_one_is_refused(smoothing: float):
    message = refusal(smoothing=smoothing)
    assert message.startswith("smoothing factor must be in (0, 1]")
    assert message.endswith(f"got {smoothing}")


@pytest.mark.parametrize("smoothing", [1.0, 0.5, 1e-9])
def test_smoothing_inside_zero_to_one_is_accepted(smoothing: float):
    assert CoordinatorConfig(world_size=1, smoothing=smoothing).smoothing == smoothing


@pytest.mark.parametrize("policy", ["ignore", "Error", "", "truncated"])
def test_an_unknown_batch_policy_is_refused_listing_the_choices(policy: str):
    message = refusal(batch_policy=policy)
    assert message == f"batch policy {policy!r} is unknown: use one of error, truncate"


@pytest.mark.parametrize("backend", ["mpi", "NCCL", ""])
def test_an_unknown_backend_is_refused_listing_the_choices(backend: str):
    assert (
        refusal(backend=backend) == f"backend {backend!r} is unknown: use one of auto, gloo, nccl"
    )


@pytest.mark.parametrize("job", ["", "has space", "-x", "j" * 129, "a/b"])
def test_a_bad_job_name_is_refused_naming_it(job: str):
    message = refusal(job=job)
    assert message.startswith(f"job name {job!r} is not allowed")
    assert "letters, digits" in message


def test_a_job_name_with_a_trailing_newline_is_refused():
    # a job name read from a file or the environment with its newline must not slip through
    assert refusal(job="epochal\n").startswith("job name 'epochal\\n' is not allowed")


@pytest.mark.parametrize("name", TIMEOUTS)
@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
def test_every_duration_must_be_a_positive_finite_number_of_seconds(name: str, value: float):
    fields: dict[str, Any] = {name: value}
    if name == "heartbeat_interval":
        fields["heartbeat_timeout"] = 1e9  # so only the interval itself is wrong
    message = refusal(**fields)
    assert message == f"{name} must be a positive number of seconds, got {value}"


@pytest.mark.parametrize(("interval", "timeout"), [(1.0, 1.0), (5.0, 2.0), (30.0, 15.0)])
def test_heartbeat_timeout_must_exceed_the_interval(interval: float, timeout: float):
    message = refusal(heartbeat_interval=interval, heartbeat_timeout=timeout)
    assert message.startswith(
        f"heartbeat_timeout ({timeout} s) must exceed heartbeat_interval ({interval} s)"
    )


def test_a_heartbeat_timeout_just_over_the_interval_is_accepted():
    cfg = CoordinatorConfig(world_size=1, heartbeat_interval=1.0, heartbeat_timeout=1.5)
    assert cfg.heartbeat_timeout == 1.5


@pytest.mark.parametrize("least", [0, 5])
def test_min_workers_outside_one_to_the_world_size_is_refused_naming_both(least: int):
    with pytest.raises(
        ConfigError, match=f"--min-workers {least} must be between 1 and the world size \\(4\\)"
    ):
        CoordinatorConfig(world_size=4, min_workers=least)


def test_a_run_is_elastic_only_when_it_may_go_on_with_fewer_workers():
    assert not CoordinatorConfig(world_size=4).elastic
    assert not CoordinatorConfig(world_size=4, min_workers=4).elastic
    elastic = CoordinatorConfig(world_size=4, min_workers=3)
    assert elastic.elastic and elastic.least_workers == 3
