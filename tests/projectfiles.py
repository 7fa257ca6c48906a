"""The project's own files, as git lists them: how a test that walks the clone finds what to
check, so that nothing else in the clone is checked as if it were the project's.

The README's quick start makes a virtual environment inside the clone, and the packages installed
there ship scripts and modules of their own (tqdm's ``completion.sh``). A walk of the directory
finds them; ``git ls-files`` does not, and a virtual environment git has not been told to ignore
(one named ``venv`` or ``env``, or a clone whose .gitignore lacks it) is left out by its marker.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

ENVIRONMENT_MARKERS = ("pyvenv.cfg", "conda-meta")
"""What a directory holds when it is a Python environment: venv's config, or conda's records."""


def project_files(repo: Path) -> list[Path]:
    """Every file of the git work tree at ``repo`` that is the project's: tracked, or new and not
    ignored (a script being written is checked before its commit), but never one inside a
    virtual environment. Sorted; paths are absolute."""
    tracked = git_names(repo, "--cached")
    untracked = git_names(repo, "--others", "--exclude-standard")
    found = [repo / name for name in tracked]
    found += [repo / name for name in untracked if not in_environment(repo, name)]
    return sorted(path for path in set(found) if path.is_file())


def git_names(repo: Path, *which: str) -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", *which, "-z"], cwd=repo, capture_output=True, check=True
    ).stdout.split(b"\0")
    return [name.decode() for name in listed if name]


def in_environment(repo: Path, name: str) -> bool:
    """Whether ``name`` (relative to ``repo``) lies inside a virtual environment."""
    parents = Path(name).parents
    return any(
        (repo / folder / marker).exists()
        for folder in list(parents)[:-1]  # the last parent is the clone itself
        for marker in ENVIRONMENT_MARKERS
    )
