"""JoinOptions: every join option read once, argument over variable over default; the guide and
the launcher say the defaults it has."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import epochal
from epochal.coordinator.config import STALL_ABORT, CoordinatorConfig
from epochal.errors import ConfigError
from epochal.launch.launcher import EXIT_MARGIN, abort_exit_timeout
from epochal.worker.joinoptions import RUN_SETTINGS, VARIABLE, JoinOptions, env_seconds
from epochal.worker.launchenv import Placement

DOCS = Path(__file__).resolve().parents[2] / "docs"
WORKER_API = DOCS / "worker-api.md"
"""The guide's page of the worker API: its options for joining, with their variables."""
SECONDS = ["connect_timeout", "collective_timeout", "abort_grace", "reattach_timeout"]
ENDPOINT = {"EPOCHAL_COORDINATOR": "tcp://127.0.0.1:4000"}


def guide_text() -> str:
    """Every page of the guide: a default is stated alike wherever it is stated."""
    return "\n".join(page.read_text(encoding="utf-8") for page in sorted(DOCS.glob("*.md")))


def joining_bullet() -> str:
    text = WORKER_API.read_text(encoding="utf-8")
    start = text.index("- Options for joining")
    return text[start : text.index("\n- ", start + 1)]


def test_the_guide_names_every_join_option():
    bullet = joining_bullet()
    names = [f.name for f in dataclasses.fields(JoinOptions) if f.name != "placement"]
    for name in [*names, "rank", "world_size"]:
        assert f"`{name}=" in bullet, f"docs/worker-api.md's joining options do not name {name}="


@pytest.mark.parametrize("name", SECONDS)
def test_the_guide_states_each_default_the_options_have(name: str):
    default = next(f.default for f in dataclasses.fields(JoinOptions) if f.name == name)
    stated = re.findall(rf"`{name}=?` \((?:default )?([0-9.]+) s[,)]", guide_text())
    assert stated, f"the guide states no default for {name}"
    assert {float(s) for s in stated} == {default}, name


def test_the_coordinator_s_default_stall_abort_is_twice_the_workers_collective_timeout():
    """So that a rank blocked in a collective ends with that timeout's own error first; the
    coordinator never imports the worker: both read the one declaration of the default."""
    assert 2 * JoinOptions().collective_timeout == STALL_ABORT
    assert CoordinatorConfig(world_size=2).stall_abort == STALL_ABORT


def test_the_launcher_waits_for_the_abort_grace_its_workers_have():
    """The launcher never imports the worker: both read the one declaration of the default, and
    the launcher the variable its workers inherit."""
    assert abort_exit_timeout({}) == JoinOptions().abort_grace + EXIT_MARGIN
    given = {"EPOCHAL_ABORT_GRACE": "7"}
    assert (
        abort_exit_timeout(given)
        == JoinOptions.from_env(given | ENDPOINT).abort_grace + EXIT_MARGIN
    )
    with pytest.raises(ConfigError, match="EPOCHAL_ABORT_GRACE"):
        abort_exit_timeout({"EPOCHAL_ABORT_GRACE": "soon"})


def test_an_argument_wins_over_its_variable_and_the_variable_over_the_default():
    env = {
        **ENDPOINT,
        "EPOCHAL_CONNECT_TIMEOUT": "7",
        "EPOCHAL_COLLECTIVE_TIMEOUT": "9",
        "EPOCHAL_ABORT_GRACE": "4",
        "EPOCHAL_REATTACH_TIMEOUT": "0",
        "EPOCHAL_JOB": "exp",
        "EPOCHAL_TOKEN": "secret",
        "EPOCHAL_WORKER_ID": "w-1",
        "EPOCHAL_RANK": "1",
        "EPOCHAL_WORLD_SIZE": "2",
        "EPOCHAL_CURVE_KEY": "k",
        "EPOCHAL_CURVE_SERVER_KEY": "s",
    }
    options = JoinOptions.from_env(env)
    assert options.coordinator == "tcp://127.0.0.1:4000"
    assert (options.connect_timeout, options.reattach_timeout) == (7.0, 0.0)
    assert (options.collective_timeout, options.abort_grace) == (9.0, 4.0)
    assert not options.reattach
    assert (options.job, options.token, options.worker_id) == ("exp", "secret", "w-1")
    assert options.placement == Placement(
        rank=1, local_rank=0, world_size=2, source="EPOCHAL_WORLD_SIZE=2"
    )
    assert (options.curve_key, options.curve_server_key) == ("k", "s")
    given = JoinOptions.from_env(
        env, coordinator="ipc:///x", connect_timeout=3.0, job="mine", rank=0, world_size=4
    )
    assert (given.coordinator, given.connect_timeout, given.job) == ("ipc:///x", 3.0, "mine")
    assert (given.placement.rank, given.placement.world_size) == (0, 4)
    defaults = JoinOptions.from_env(ENDPOINT, job=None, abort_grace=None)
    assert (defaults.job, defaults.abort_grace, defaults.connect_timeout) == ("epochal", 2.0, 120.0)
    assert defaults.worker_id  # HOST/PID/random


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"EPOCHAL_CONNECT_TIMEOUT": "soon"}, "EPOCHAL_CONNECT_TIMEOUT='soon' is not a number"),
        ({"EPOCHAL_CONNECT_TIMEOUT": "0"}, "EPOCHAL_CONNECT_TIMEOUT must be a positive number"),
        ({"EPOCHAL_REATTACH_TIMEOUT": "-1"}, "EPOCHAL_REATTACH_TIMEOUT must be a positive"),
        ({"EPOCHAL_ABORT_GRACE": "-2"}, "EPOCHAL_ABORT_GRACE must be a positive number"),
        ({"EPOCHAL_COLLECTIVE_TIMEOUT": "x"}, "EPOCHAL_COLLECTIVE_TIMEOUT='x' is not a number"),
        ({"EPOCHAL_JOB": "no spaces"}, "job name 'no spaces' is not allowed"),
        ({"EPOCHAL_RANK": "x"}, "EPOCHAL_RANK='x' is not an integer"),
    ],
)
def test_a_bad_variable_is_refused_naming_it(env: dict[str, str], message: str):
    with pytest.raises(ConfigError, match=re.escape(message)):
        JoinOptions.from_env({**ENDPOINT, **env})


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"collective_timeout": 0}, "collective_timeout must be a positive number of seconds"),
        ({"abort_grace": -1.0}, "abort_grace must be a positive number of seconds, got -1.0"),
        ({"reattach_timeout": -1.0}, "reattach_timeout must be >= 0 seconds (0: never)"),
    ],
)
def test_a_bad_value_is_refused_naming_it(given: dict[str, float], message: str):
    with pytest.raises(ConfigError, match=re.escape(message)):
        JoinOptions(**given)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=re.escape(message)):
        JoinOptions.from_env(ENDPOINT, **given)


def test_no_coordinator_says_how_to_give_one():
    with pytest.raises(ConfigError, match="set EPOCHAL_COORDINATOR"):
        JoinOptions.from_env({})


def test_an_unknown_option_is_a_type_error_as_it_was():
    with pytest.raises(TypeError, match="unexpected keyword argument 'coordinatr'"):
        JoinOptions.from_env(ENDPOINT, coordinatr="tcp://127.0.0.1:1")
    with pytest.raises(TypeError, match="unexpected keyword argument 'coordinatr'"):
        epochal.join(None, coordinatr="tcp://127.0.0.1:1")  # type: ignore[arg-type]


def test_env_seconds_reads_an_unset_or_empty_variable_as_the_default():
    assert env_seconds({}, "X", 4.0) == 4.0
    assert env_seconds({"X": ""}, "X", 4.0) == 4.0
    assert env_seconds({"X": "0"}, "X", 4.0, allow_zero=True) == 0.0


def test_every_option_with_a_variable_is_read_from_it_and_its_default_is_the_fields():
    """One declaration: the variable and the default live on the field, and from_env reads both."""
    declared = {
        f.name: f.metadata[VARIABLE][0]
        for f in dataclasses.fields(JoinOptions)
        if VARIABLE in f.metadata
    }
    assert set(declared) >= {*SECONDS, "job", "token", "worker_id", "curve_key"}
    text = WORKER_API.read_text(encoding="utf-8")
    for name, variable in declared.items():
        assert variable in text, f"docs/worker-api.md does not name {variable} ({name})"
    defaults = JoinOptions.from_env(ENDPOINT)
    for name in SECONDS:
        field = next(f for f in dataclasses.fields(JoinOptions) if f.name == name)
        assert getattr(defaults, name) == field.default, name
        value = JoinOptions.from_env({**ENDPOINT, declared[name]: "42"})
        assert getattr(value, name) == 42.0, name


@pytest.mark.parametrize("name", sorted(RUN_SETTINGS))
def test_the_heartbeats_are_the_runs_and_a_worker_argument_says_where_to_set_them(name: str):
    flag = "--" + name.replace("_", "-")
    with pytest.raises(TypeError, match=f"no longer takes '{name}'.*coordinator \\({flag}\\)"):
        JoinOptions.from_env(ENDPOINT, **{name: 3.0})
