"""What every test shares: a configuration directory of its own, never the real home's, the
worker's hello that the coordinator and security tests send, how many processes run the suite,
and a garbage collection after each test, so that what a test leaves open fails that test.

The suite runs under pytest-xdist (``-n auto --dist loadgroup`` in pyproject.toml), with
:data:`WORKERS_PER_CPU` test processes per CPU (``PYTEST_XDIST_AUTO_NUM_WORKERS`` or ``-n N``
overrides it, ``-n 0`` runs in one process). Tests that share something expensive or exclusive
(a private dockerd, a Slurm cluster, a module-scoped run of ranks) carry one
``pytest.mark.xdist_group`` each, so that one process runs them all and sets it up once.

Checkpoints are signed with a key that epochal makes on first use in ``$XDG_CONFIG_HOME/epochal``
(:mod:`epochal.rundir.checkpointkey`). For the whole session that variable names a private temporary
directory, so the tests and every process they start (which inherit it) share one key there and
nothing is written under the home of whoever runs the tests. Under pytest-xdist each worker
process has a session, and so a directory and a key, of its own.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from epochal.environment import PRELOAD_SOCKET_ENV
from epochal.launch.preload import worker_threads
from epochal.protocol import MESSAGE_TYPES, OPTIONAL_TYPES, TYPE_NAMES, Fingerprint, Hello
from tests import ordering
from tests.forked import start_server
from tests.fresh import whole_suite

FINGERPRINT = Fingerprint(digest="a" * 64, torch_version="x", entries=1)
"""A model's fingerprint as a hello carries it: a digest of the wire's length, one entry."""


@pytest.fixture
def registry() -> Iterator[None]:
    """Messages a test defines (``@message``) are forgotten after it."""
    saved = dict(MESSAGE_TYPES), dict(TYPE_NAMES), set(OPTIONAL_TYPES)
    yield
    MESSAGE_TYPES.clear()
    MESSAGE_TYPES.update(saved[0])
    TYPE_NAMES.clear()
    TYPE_NAMES.update(saved[1])
    OPTIONAL_TYPES.clear()
    OPTIONAL_TYPES.update(saved[2])


def hello(worker_id: str = "w0", fingerprint: Fingerprint = FINGERPRINT, **fields: Any) -> Hello:
    """A worker's hello: job ``epochal``, no token, pid 1 on ``testhost``, no rank asked for, on
    the CPU, with ``fingerprint``; any other field as given."""
    given: dict[str, Any] = {
        "job": "epochal",
        "token": "",
        "host": "testhost",
        "pid": 1,
        "rank_hint": None,
        "device": "cpu",
        **fields,
    }
    return Hello(worker_id=worker_id, fingerprint=fingerprint, **given)


WORKERS_PER_CPU = 2
"""Test processes per CPU under ``-n auto``. The multi-process tests spend much of their time
waiting on timeouts they configure (a stall, a heartbeat, a lost worker), so more test processes
than CPUs keep the CPUs busy. Each test process forks its processes from one that imported torch
once (:mod:`tests.forked`), so the suite's CPU was about 1,000 core-seconds (now about 670);
on two idle cores one process per CPU then took 9:24 and two took 8:52, the CPUs 93 % busy.
(Before the processes were forked, when the suite took 2,250 core-seconds, 6 test processes on
two cores took 37 minutes with tests failed past their deadlines; 4 took 26 minutes.)"""

MAX_WORKERS = 16
"""At most this many under ``-n auto``: each one imports torch (about 250 MB) before a test."""


def pytest_configure(config: pytest.Config) -> None:
    """The suite's processes write Python's bytecode caches, even where
    ``PYTHONDONTWRITEBYTECODE`` is set: hundreds of them start as fresh interpreters that import
    epochal (coordinators, the workers of ``epochal worker``, command lines), and without the
    caches each compiled epochal's modules from source again. ``--write-durations``: the
    controller records the modules' times."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False
    if config.getoption("write_durations") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(ordering.Recorder(), "epochal-durations")


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: :data:`WORKERS_PER_CPU` per CPU this process may run on, at most
    :data:`MAX_WORKERS`; ``PYTEST_XDIST_AUTO_NUM_WORKERS`` when set."""
    given = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if given:
        return int(given)
    return min(MAX_WORKERS, WORKERS_PER_CPU * len(os.sched_getaffinity(0)))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--write-durations",
        action="store_true",
        help="write each test module's time in this run to tests/durations.json, which orders "
        "the modules under pytest-xdist (tests/ordering.py)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, the longest modules are handed out first, the quick ones make the end
    (:mod:`tests.ordering`). Without xdist (``-n 0``) the order collected is kept."""
    if hasattr(config, "workerinput"):  # each test process sorts alike; the controller need not
        ordering.order(items, float(config.getini("timeout") or 0))


@pytest.fixture(autouse=True, scope="session")
def private_config_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    home = tmp_path_factory.mktemp("config-home")
    home.chmod(0o700)
    before = os.environ.get("XDG_CONFIG_HOME")
    os.environ["XDG_CONFIG_HOME"] = str(home)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("XDG_CONFIG_HOME", None)
        else:
            os.environ["XDG_CONFIG_HOME"] = before


@pytest.fixture(autouse=True, scope="session")
def preloaded(
    private_config_home: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """One ``epochal preload`` per test process, named in ``EPOCHAL_PRELOAD_SOCKET`` for the
    whole session (:mod:`tests.forked`): every launch forks its workers from it and the tests'
    own processes are forked from it, so torch is imported once here rather than in each. A test
    that needs launches to start their own unsets the variable. Under ``EPOCHAL_TEST_FRESH``
    there is none, and the variable is unset for the session (:mod:`tests.fresh`)."""
    before = os.environ.pop(PRELOAD_SOCKET_ENV, None)
    server = None
    if not whole_suite():
        path, server = start_server(tmp_path_factory.mktemp("preload"), worker_threads(os.environ))
        os.environ[PRELOAD_SOCKET_ENV] = path
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(PRELOAD_SOCKET_ENV, None)
        else:
            os.environ[PRELOAD_SOCKET_ENV] = before
        if server is not None:
            server.kill()
            server.wait()


@pytest.fixture(autouse=True)
def collected() -> Iterator[None]:
    """After each test (its other fixtures torn down, its event loop closed), collect the garbage:
    a socket, pipe or file the test left open in a reference cycle is finalized here, and its
    ResourceWarning (an error under ``filterwarnings``) fails the test that leaked it rather than
    whichever test the collector happened to run in later in the same process.

    A full collection walks every tracked object, torch's and the rest (0.1 to 0.4 s a test
    here); what survives the test is frozen (``gc.freeze``), so the next one walks only what
    later tests make: 0.5 ms a test, about 1.6 % of the time of 1,375 fast tests, with less of
    the collector's own work during tests in return (their wall time was the same). What is
    frozen is never collected as a cycle again; it is still freed when the last reference to it
    goes, so what a longer-lived fixture holds is closed by that fixture as before."""
    yield
    gc.collect()
    gc.freeze()
