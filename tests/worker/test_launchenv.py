"""Launch-environment detection: a pure function of the environment, table-tested."""

from __future__ import annotations

import pytest

from epochal.errors import ConfigError
from epochal.worker import launchenv
from epochal.worker.launchenv import Placement, check_world_size, detect, placement

TORCHRUN = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "x"}
SLURM = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "5", "SLURM_LOCALID": "2", "SLURM_NTASKS": "8"}
INDEXED = {"JOB_COMPLETION_INDEX": "2"}


@pytest.mark.parametrize(
    ("env", "launcher"),
    [
        ({}, None),
        (TORCHRUN, "torchrun"),
        (SLURM, "Slurm"),
        (INDEXED, "Kubernetes Indexed Job"),
        # torchrun inside a Slurm allocation: torchrun's variables describe this process
        ({**SLURM, **TORCHRUN}, "torchrun"),
        # RANK/WORLD_SIZE without torchelastic's run id: some other tool set them, not torchrun
        ({"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, None),
        # the batch step of an allocation is not a task of a step unless every variable is there
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "8"}, None),
        ({k: v for k, v in SLURM.items() if k != "SLURM_JOB_ID"}, None),
        ({**INDEXED, **SLURM}, "Slurm"),
    ],
)
def test_detect(env: dict[str, str], launcher: str | None) -> None:
    found = detect(env)
    assert (found.name if found else None) == launcher


@pytest.mark.parametrize(
    ("env", "args", "expected"),
    [
        ({}, {}, (None, 0, None)),
        (TORCHRUN, {}, (3, 1, 4)),
        (SLURM, {}, (5, 2, 8)),
        (INDEXED, {}, (2, 0, None)),
        ({**INDEXED, "EPOCHAL_WORLD_SIZE": "3"}, {}, (2, 0, 3)),
        # EPOCHAL_* variables beat the launcher's
        ({**SLURM, "EPOCHAL_RANK": "0", "EPOCHAL_LOCAL_RANK": "0"}, {}, (0, 0, 8)),
        ({**SLURM, "EPOCHAL_WORLD_SIZE": "2"}, {}, (5, 2, 2)),
        # explicit arguments beat both
        ({**SLURM, "EPOCHAL_RANK": "1"}, {"rank": 4}, (4, 2, 8)),
        ({**SLURM, "EPOCHAL_WORLD_SIZE": "2"}, {"world_size": 16}, (5, 2, 16)),
        # an empty EPOCHAL_* variable is unset
        ({**TORCHRUN, "EPOCHAL_RANK": "", "EPOCHAL_WORLD_SIZE": ""}, {}, (3, 1, 4)),
    ],
)
def test_placement_precedence(
    env: dict[str, str], args: dict[str, int], expected: tuple[int | None, int, int | None]
) -> None:
    found = placement(env, **args)
    assert (found.rank, found.local_rank, found.world_size) == expected


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({**SLURM, "SLURM_PROCID": "x"}, "SLURM_PROCID='x' is not an integer"),
        ({**SLURM, "SLURM_NTASKS": "0"}, "SLURM_NTASKS='0' must be >= 1"),
        ({**SLURM, "SLURM_PROCID": "8"}, "rank 8 of a world of 8"),
        ({**TORCHRUN, "LOCAL_RANK": "-1"}, "LOCAL_RANK='-1' must be >= 0"),
        ({**INDEXED, "JOB_COMPLETION_INDEX": "two"}, "JOB_COMPLETION_INDEX='two'"),
        ({"EPOCHAL_WORLD_SIZE": "0"}, "EPOCHAL_WORLD_SIZE must be >= 1"),
        ({"EPOCHAL_RANK": "one"}, "EPOCHAL_RANK='one' is not an integer"),
    ],
)
def test_bad_values_are_named(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        placement(env)


def test_world_size_check_names_both_sizes_and_the_source() -> None:
    slurm = placement(SLURM)
    assert check_world_size(slurm, 8) is None
    message = check_world_size(slurm, 2)
    assert message is not None
    assert "world of 8 workers (Slurm (SLURM_NTASKS=8))" in message
    assert "coordinator runs a world of 2" in message
    assert "--world-size 8" in message
    explicit = placement({"EPOCHAL_WORLD_SIZE": "3"})
    assert "EPOCHAL_WORLD_SIZE=3" in (check_world_size(explicit, 2) or "")
    unknown = Placement(rank=None, local_rank=0, world_size=None, source="")
    assert check_world_size(unknown, 5) is None


def test_registry_order_is_torchrun_slurm_indexed_job() -> None:
    assert [e.name for e in launchenv.LAUNCH_ENVIRONMENTS] == [
        "torchrun",
        "Slurm",
        "Kubernetes Indexed Job",
    ]
