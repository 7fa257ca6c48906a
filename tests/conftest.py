"""What every test shares: a configuration directory of its own, never the real home's.

Checkpoints are signed with a key that epochal makes on first use in ``$XDG_CONFIG_HOME/epochal``
(:mod:`epochal.checkpointkey`). For the whole session that variable names a private temporary
directory, so the tests and every process they start (which inherit it) share one key there and
nothing is written under the home of whoever runs the tests.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


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
