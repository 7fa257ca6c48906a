"""deploy/systemd: the unit verifies cleanly, restarts exactly a crash, and a restart resumes.

No systemd runs as PID 1 here, so the unit's ExecStart is built the way systemd builds it (the
environment file, ``%i``, ``${VAR}`` as one word and ``$VAR`` split on spaces), and systemd's
``Restart=`` rules (systemd.service(5)) are modelled by :func:`restarts` and table-tested. The
coordinator runs on a network-namespace host with a fixed port, as on a server; it is SIGKILLed
mid-run (as the OOM killer would), started again after ``RestartSec``, and the workers on the other
hosts re-attach and finish.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from epochal.cli import parser as cli
from epochal.launch.daemon import EXIT_CRASH
from tests.integration.conftest import wait_for_record
from tests.multihost import netns
from tests.multihost.test_across_hosts import clean_env

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "deploy" / "systemd" / "epochal-coordinator@.service"
EXAMPLE_ENV = REPO / "deploy" / "systemd" / "example.env"
RESUMABLE = REPO / "tests" / "integration" / "scripts" / "resumable.py"
RUN_DEADLINE = 300.0  # a whole short training run on a loaded machine: a hang, not a bound
CLEAN_SIGNALS = {signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE}


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """Sections -> key -> every value given (continuation lines joined, comments dropped)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    pending = ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        pending = ""
        if not line or line[0] in "#;":
            continue
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, value = line.split("=", 1)
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def service() -> dict[str, list[str]]:
    return parse_unit(UNIT.read_text())["Service"]


def one(key: str) -> str:
    (value,) = service()[key]
    return value


def parse_env_file(text: str) -> dict[str, str]:
    env = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";")):
            key, value = line.split("=", 1)
            env[key.strip()] = value.strip().strip('"')
    return env


def exec_start(instance: str, env: dict[str, str]) -> list[str]:
    """ExecStart as systemd runs it: specifiers, then ${VAR} as one word, $VAR split."""
    words = one("ExecStart").replace("%i", instance).split()
    argv: list[str] = []
    for word in words:
        if re.fullmatch(r"\$\{\w+\}", word):
            argv.append(env.get(word[2:-1], ""))
        elif re.fullmatch(r"\$\w+", word):
            argv.extend(env.get(word[1:], "").split())
        else:
            argv.append(word)
    return argv


def statuses(key: str) -> set[int]:
    return {int(v) for value in service().get(key, []) for v in value.split()}


def restarts(returncode: int) -> bool:
    """Whether systemd restarts the unit after its main process ended with ``returncode``.

    ``returncode`` as subprocess reports it (negative: killed by that signal). Restart=on-abnormal
    restarts after an unclean signal (not SIGHUP, SIGINT, SIGTERM, SIGPIPE, nor one listed in
    SuccessExitStatus), a timeout or a watchdog, never after an exit code;
    RestartForceExitStatus restarts those statuses anyway, RestartPreventExitStatus never.
    """
    assert one("Restart") == "on-abnormal"
    if returncode >= 0:
        if returncode in statuses("RestartPreventExitStatus"):
            return False
        return returncode in statuses("RestartForceExitStatus")
    return signal.Signals(-returncode) not in CLEAN_SIGNALS


# ---------------------------------------------------------------------- static checks


def verify_root(tmp_path: Path, unit_text: str) -> Path:
    """A root holding the unit, systemd's own units and the executable ExecStart names."""
    source = Path("/usr/lib/systemd/system")
    if shutil.which("systemd-analyze") is None or not source.is_dir():
        pytest.skip("systemd is not installed (apt-get install systemd); .ci/run installs it")
    root = tmp_path / "root"
    shutil.copytree(source, root / "usr/lib/systemd/system", symlinks=True)
    units = root / "etc/systemd/system"
    units.mkdir(parents=True)
    (units / UNIT.name).write_text(unit_text)
    executable = root / exec_start("demo", {})[0].lstrip("/")
    executable.parent.mkdir(parents=True)
    executable.write_text("#!/bin/sh\n")
    executable.chmod(0o755)
    return root


def verify(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", "epochal-coordinator@demo.service"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_systemd_analyze_verify_prints_nothing(tmp_path: Path) -> None:
    done = verify(verify_root(tmp_path, UNIT.read_text()))
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


def test_systemd_analyze_verify_does_see_a_bad_line(tmp_path: Path) -> None:
    broken = UNIT.read_text().replace("ProtectSystem=strict", "ProtectSystm=strict")
    done = verify(verify_root(tmp_path, broken))
    assert "ProtectSystm" in done.stdout + done.stderr


def test_the_unit_restarts_a_crash_and_nothing_else() -> None:
    assert restarts(-signal.SIGKILL) and restarts(-signal.SIGSEGV) and restarts(-signal.SIGABRT)
    assert restarts(EXIT_CRASH)
    assert not restarts(0)  # finished
    assert not restarts(1)  # aborted: a lost worker, a policy refusal; restarting repeats it
    assert not restarts(cli.EXIT_USAGE)
    assert not restarts(-signal.SIGTERM)
    # `systemctl stop` sends SIGTERM; the coordinator aborts the run on purpose and exits 143
    for signum in (signal.SIGTERM, signal.SIGINT):
        assert 128 + signum in statuses("SuccessExitStatus") and not restarts(128 + signum)


def test_the_run_directory_is_fixed_and_the_only_writable_path() -> None:
    argv = exec_start("demo", parse_env_file(EXAMPLE_ENV.read_text()))
    run_dir = argv[argv.index("--run-dir") + 1]
    assert run_dir == "/var/lib/epochal/demo"
    assert one("StateDirectory").replace("%i", "demo") == "epochal/demo"
    assert one("ReadWritePaths").replace("%i", "demo") == run_dir
    assert one("ProtectSystem") == "strict" and one("NoNewPrivileges") == "yes"
    assert one("EnvironmentFile").replace("%i", "demo") == "/etc/epochal/demo.env"
    # the example environment file fills every variable ExecStart uses
    used = set(re.findall(r"\$\{?(\w+)\}?", one("ExecStart")))
    assert used <= set(parse_env_file(EXAMPLE_ENV.read_text()))


# ---------------------------------------------------------------------- a crash and a restart


@pytest.mark.slow
@pytest.mark.timeout(int(RUN_DEADLINE) * 2)
def test_a_killed_coordinator_restarted_as_the_unit_says_takes_the_workers_back(
    tmp_path: Path,
) -> None:
    reason = netns.available()
    if reason is not None:
        pytest.skip(reason)
    instance = "demo"
    keys = tmp_path / "etc/epochal" / instance
    subprocess.run(
        [sys.executable, "-m", "epochal", "keys", "generate", "--workers", "2", str(keys)],
        check=True,
        capture_output=True,
        env=clean_env(),
    )
    state = tmp_path / "var/lib/epochal" / instance  # StateDirectory=, made by systemd
    state.mkdir(parents=True, mode=0o700)
    env_file = tmp_path / f"{instance}.env"
    options = "--epochs 4 --lr-schedule step:every=2,gamma=0.5 --heartbeat-timeout 5"
    options += f" --curve-key /etc/epochal/{instance}/coordinator.key_secret"
    options += f" --curve-allowed /etc/epochal/{instance}/allowed"
    env_file.write_text(
        "EPOCHAL_BIND=tcp://0.0.0.0:29400\n"
        "EPOCHAL_WORLD_SIZE=2\n"
        f"EPOCHAL_COORDINATOR_OPTIONS={options}\n"
    )
    unit_env = parse_env_file(env_file.read_text())
    argv = exec_start(instance, unit_env)
    assert argv[:2] == ["/opt/epochal/bin/epochal", "coordinator"]
    # the installed paths, under this test's root
    argv = [sys.executable, "-m", "epochal"] + [
        str(tmp_path) + a if a.startswith(("/etc/epochal/", "/var/lib/epochal/")) else a
        for a in argv[1:]
    ]
    restart_sec = float(one("RestartSec").removesuffix("s"))

    with netns.hosts(3) as net:
        logs: list[Path] = []

        def start(host: netns.Host, command: list[str], env: dict[str, str], name: str):
            log = tmp_path / f"{name}.log"
            logs.append(log)
            with log.open("ab") as sink:
                proc = host.popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT)
            return proc, log

        def dump() -> str:
            return "\n".join(f"--- {p.name}\n{p.read_text()}" for p in logs if p.exists())

        def wait(proc: subprocess.Popen[bytes]) -> int:
            try:
                return proc.wait(timeout=RUN_DEADLINE)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{proc.args} ran past {RUN_DEADLINE} s\n{dump()}")

        service_env = clean_env(**unit_env)
        coordinator, _ = start(net[0], argv, service_env, "coordinator")
        endpoint = f"tcp://{net[0].address}:29400"
        work = ["python", str(RESUMABLE), "--out", str(tmp_path / "out"), "--delay", "0.02"]
        workers = [
            start(
                net[1 + i],
                work,
                clean_env(
                    EPOCHAL_COORDINATOR=endpoint,
                    EPOCHAL_CURVE_KEY=str(keys / "workers" / f"worker-{i}.key_secret"),
                    EPOCHAL_CURVE_SERVER_KEY=str(keys / "coordinator.key"),
                    EPOCHAL_RANK=str(i),
                ),
                f"worker{i}",
            )
            for i in range(2)
        ]
        wait_for_record(state, "checkpoint", RUN_DEADLINE, alive=coordinator)
        os.killpg(coordinator.pid, signal.SIGKILL)  # as the OOM killer would
        code = wait(coordinator)
        assert code == -signal.SIGKILL and restarts(code), dump()
        time.sleep(restart_sec)
        again, again_log = start(net[0], argv, service_env, "coordinator-again")
        for proc, log in workers:
            assert wait(proc) == 0, dump()
            assert "the restarted coordinator carries on from its journal" in log.read_text()
        code = wait(again)
        assert code == 0 and not restarts(code), dump()
        said = again_log.read_text()
        assert "every worker is back (2); the run carries on in epoch" in said, dump()
        assert "resuming" not in said, dump()  # taken back where they were, nothing redone
        result = json.loads((state / "result.json").read_text())
        assert result["status"] == "finished" and result["epochs_run"] == 4, result
        net.close()
        assert not net.leftover()
