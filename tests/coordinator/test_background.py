"""start_coordinator: a coordinator on a thread of the caller's process, and its lifecycle."""

from __future__ import annotations

import threading

import pytest

import epochal
from epochal.errors import ConfigError, RunAborted


def coordinator_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "epochal-coordinator"]


def test_endpoint_is_bound_and_abort_ends_the_run_with_the_reason() -> None:
    lines: list[str] = []
    coordinator = epochal.start_coordinator(world_size=2, epochs=3, log=lines.append)
    with coordinator:
        assert coordinator.endpoint.startswith("tcp://127.0.0.1:")
        assert not coordinator.endpoint.endswith(":0")
        assert coordinator.running
        with pytest.raises(TimeoutError, match="still going"):
            coordinator.wait(timeout=0.05)
        coordinator.abort("stopped by the test")
        with pytest.raises(RunAborted, match="stopped by the test"):
            coordinator.wait(timeout=30)
    assert not coordinator.running
    assert any("stopped by the test" in line for line in lines)
    assert not coordinator_threads()


def test_leaving_the_block_aborts_a_run_still_going() -> None:
    with epochal.start_coordinator(world_size=1, log=lambda line: None) as coordinator:
        pass
    assert not coordinator.running
    with pytest.raises(RunAborted, match=r"block ended before the run finished"):
        coordinator.wait()


def test_an_exception_in_the_block_aborts_naming_it() -> None:
    with (
        pytest.raises(KeyError),
        epochal.start_coordinator(world_size=1, log=lambda line: None) as coordinator,
    ):
        raise KeyError("x")
    with pytest.raises(RunAborted, match="the caller raised KeyError"):
        coordinator.wait()


def test_the_rendezvous_timeout_aborts_by_itself() -> None:
    coordinator = epochal.start_coordinator(
        world_size=2, rendezvous_timeout=0.3, log=lambda line: None
    )
    with coordinator, pytest.raises(RunAborted, match=r"only 0 of 2 workers joined within 0\.3 s"):
        # bounded by the configured rendezvous timeout, plus generous margin for a busy machine
        coordinator.wait(timeout=0.3 + 30)


def test_unknown_and_invalid_options_are_refused_before_a_thread_starts() -> None:
    with pytest.raises(ConfigError, match=r"unknown option.*epoch\b.*epochs"):
        epochal.start_coordinator(world_size=2, epoch=3)
    with pytest.raises(ConfigError, match="epochs must be >= 1"):
        epochal.start_coordinator(world_size=2, epochs=0)
    assert not coordinator_threads()


def test_a_bind_that_fails_is_raised_in_the_caller() -> None:
    with epochal.start_coordinator(world_size=1, log=lambda line: None) as first:
        with pytest.raises(OSError, match="cannot bind the coordinator"):
            epochal.start_coordinator(world_size=1, bind=first.endpoint)
        first.abort("done")
    assert not coordinator_threads()


def test_run_dir_may_be_a_string(tmp_path) -> None:
    with epochal.start_coordinator(
        world_size=1, run_dir=str(tmp_path / "run"), log=lambda line: None
    ) as coordinator:
        assert coordinator.config.run_dir == tmp_path / "run"
        assert (tmp_path / "run" / "run.json").exists()
        coordinator.abort("done")
