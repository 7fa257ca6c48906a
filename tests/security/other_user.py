"""Running a command as another local user (``nobody``), for the tests of a shared machine.

CI runs the suite as root, which may switch to any user; elsewhere the tests that need a second
user are skipped, saying why.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

OTHER_UID = 65534
"""The second user: ``nobody``."""

AS_OTHER_USER = [
    "setpriv",
    "--reuid",
    str(OTHER_UID),
    "--regid",
    str(OTHER_UID),
    "--clear-groups",
    "--",
]
"""The prefix that runs a command as the second user, with no supplementary groups."""

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="acting as a second local user needs root (setpriv), as in CI"
)


def as_other_user(
    command: Sequence[str], *, timeout: float = 60, check: bool = True, **kwargs: object
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` as uid/gid 65534 with no supplementary groups; its output captured."""
    return subprocess.run(
        [*AS_OTHER_USER, *command],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=check,
        **kwargs,  # type: ignore[arg-type]
    )


@contextlib.contextmanager
def shared_scratch() -> Iterator[Path]:
    """A directory every local user may create entries in (mode 1777, like /tmp), removed after.

    pytest's own temporary directories are closed to other users, so a second user could not
    reach into them."""
    root = Path(tempfile.mkdtemp(prefix="epochal-shared-"))
    try:
        os.chmod(root, 0o1777)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)
