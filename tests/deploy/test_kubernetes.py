"""deploy/kubernetes: schema-valid for Kubernetes 1.30, renders with kustomize, and runs.

No cluster exists here, so the last test does what a kubelet would with these manifests: it reads
the YAML, builds each container's command line and environment (the pod IP from the downward API,
``JOB_COMPLETION_INDEX`` for the Indexed Job's pods, the Secret files with their mode, the shared
volume, the Service name in the pod's ``/etc/hosts``) and runs the coordinator pod and two worker
pods as processes on three network-namespace hosts. The digits job must finish.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from secrets import token_hex
from typing import Any

import pytest

from epochal.rundir.checkpointkey import CheckpointKey
from tests.multihost import netns

yaml = pytest.importorskip("yaml", reason="pip install pyyaml (.ci/run installs it)")

REPO = Path(__file__).resolve().parents[2]
KUBE = REPO / "deploy" / "kubernetes"
MANIFESTS = sorted(p for p in KUBE.glob("*.yaml") if p.name != "kustomization.yaml")
KUBERNETES_VERSION = "1.30.0"
RUN_DEADLINE = 600.0  # a whole 15-epoch training run on a loaded machine: a hang, not a bound
IMAGE_WORKDIR = "/app"  # deploy/container/Dockerfile's WORKDIR, where the image keeps examples/


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed; .ci/run installs it")
    return path


def validate(*files: Path) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    command = [sys.executable, "-m", "kubernetes_validate", "-k", KUBERNETES_VERSION, "--strict"]
    return subprocess.run(
        [*command, *map(str, files)], capture_output=True, text=True, timeout=120, check=False
    )


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def resources() -> dict[str, dict[str, Any]]:
    """Every resource in deploy/kubernetes, by ``Kind/name``."""
    return {f"{d['kind']}/{d['metadata']['name']}": d for p in MANIFESTS for d in documents(p)}


# ---------------------------------------------------------------------- static checks


def test_every_manifest_is_valid_for_kubernetes_1_30_strictly() -> None:
    assert {p.name for p in MANIFESTS} >= {"coordinator.yaml", "workers.yaml", "storage.yaml"}
    for manifest in MANIFESTS:
        done = validate(manifest)
        assert done.returncode == 0, f"{manifest.name}:\n{done.stdout}{done.stderr}"
        assert "passed" in done.stdout, done.stdout


def test_the_validator_rejects_an_unknown_field(tmp_path: Path) -> None:
    # proves --strict checks something: a misspelt field of the Service fails
    broken = tmp_path / "coordinator.yaml"
    text = (KUBE / "coordinator.yaml").read_text()
    broken.write_text(text.replace("publishNotReadyAddresses:", "publishNotReadyAddress:", 1))
    done = validate(broken)
    assert done.returncode != 0, done.stdout
    assert "publishNotReadyAddress" in done.stdout + done.stderr


def test_kustomize_renders_every_resource_and_the_render_is_valid(tmp_path: Path) -> None:
    done = subprocess.run(
        [tool("kubectl"), "kustomize", str(KUBE)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    rendered = [d for d in yaml.safe_load_all(done.stdout) if d]
    kinds = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in rendered)
    assert kinds == sorted(resources())
    for doc in rendered:
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "epochal"
    out = tmp_path / "rendered.yaml"
    out.write_text(done.stdout)
    checked = validate(out)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def pod_spec(resource: dict[str, Any]) -> dict[str, Any]:
    return resource["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def container(resource: dict[str, Any]) -> dict[str, Any]:
    (only,) = pod_spec(resource)["containers"]
    return only  # type: ignore[no-any-return]


def option(args: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    return value


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def test_the_manifests_agree_with_each_other() -> None:
    found = resources()
    service = found["Service/epochal-coordinator"]
    coordinator = found["StatefulSet/epochal-coordinator"]
    job = found["Job/epochal-workers"]
    pvc = found["PersistentVolumeClaim/epochal-runs"]
    c, w = container(coordinator), container(job)
    args, env = c["args"], env_of(w)

    # the world size, written in four places
    world = int(option(args, "--world-size"))
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == world
    assert int(env["EPOCHAL_WORLD_SIZE"]) == world
    # workers dial the Service by name, on the port the coordinator binds and the Service serves
    dial = re.fullmatch(r"tcp://([a-z0-9-]+):(\d+)", env["EPOCHAL_COORDINATOR"])
    assert dial is not None
    bind_port = int(option(args, "--bind").rsplit(":", 1)[1])
    assert dial.group(1) == service["metadata"]["name"] == coordinator["spec"]["serviceName"]
    assert int(dial.group(2)) == bind_port == service["spec"]["ports"][0]["port"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    assert service["spec"]["selector"] == coordinator["spec"]["template"]["metadata"]["labels"]
    assert "readinessProbe" in c
    assert coordinator["spec"]["replicas"] == 1
    # workers: an Indexed Job whose pods advertise their own IP
    assert job["spec"]["completionMode"] == "Indexed"
    assert env["EPOCHAL_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # keys: Secrets, read-only to their owner
    for resource in (coordinator, job):
        secrets = [v["secret"] for v in pod_spec(resource)["volumes"] if "secret" in v]
        assert secrets and all(s["defaultMode"] == 0o400 for s in secrets)
    # one checkpoint key, the same Secret in every pod, where the variable says it is
    for resource in (coordinator, job):
        volumes = {v["name"]: v for v in pod_spec(resource)["volumes"]}
        assert volumes["checkpoint-key"]["secret"]["secretName"] == "epochal-checkpoint-key"
        mounts = container(resource)["volumeMounts"]
        (mounted,) = [m["mountPath"] for m in mounts if m["name"] == "checkpoint-key"]
        assert env_of(container(resource))["EPOCHAL_CHECKPOINT_KEY_FILE"] == (
            f"{mounted}/checkpoint.key"
        )
    # one ReadWriteMany volume holding the run directory, at the same path in every pod
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    mounts = [
        {m["mountPath"] for m in container(r)["volumeMounts"] if m["name"] == "runs"}
        for r in (coordinator, job)
    ]
    assert mounts[0] == mounts[1] == {f"{IMAGE_WORKDIR}/runs"}
    assert option(args, "--run-dir").startswith("runs/")
    # /dev/shm memory-backed for the workers
    shm = {v["name"]: v for v in pod_spec(job)["volumes"]}["dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in w["volumeMounts"]
    # GPUs are one uncommented line away
    assert "# nvidia.com/gpu: 1" in (KUBE / "workers.yaml").read_text()


# ---------------------------------------------------------------------- pods as processes


class Pod:
    """One pod of a manifest, run as a process on a network-namespace host as a kubelet would."""

    def __init__(
        self,
        name: str,
        resource: dict[str, Any],
        host: netns.Host,
        root: Path,
        secrets: dict[str, dict[str, bytes]],
        claims: dict[str, Path],
        hosts_file: str,
        extra_env: dict[str, str],
    ) -> None:
        self.name = name
        self.host = host
        self.root = root / name
        self.spec = pod_spec(resource)
        self.container = container(resource)
        self.mounts: dict[str, Path] = {}
        self.workdir = self.root / "app"
        self.workdir.mkdir(parents=True)
        (self.workdir / "examples").symlink_to(REPO / "examples")  # what the image holds
        volumes = {v["name"]: v for v in self.spec["volumes"]}
        for mount in self.container["volumeMounts"]:
            self._mount(mount, volumes[mount["name"]], secrets, claims)
        self.hosts = self.root / "hosts"
        self.hosts.write_text(hosts_file)
        self.env = self._environment(extra_env)
        self.argv = [self._path(a) for a in self._expand(self.container["command"])]
        self.argv += [self._path(a) for a in self._expand(self.container.get("args", []))]
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = self.root / "log"

    def _mount(
        self,
        mount: dict[str, Any],
        volume: dict[str, Any],
        secrets: dict[str, dict[str, bytes]],
        claims: dict[str, Path],
    ) -> None:
        path = mount["mountPath"]
        if "secret" in volume:
            data = secrets[volume["secret"]["secretName"]]
            mode = volume["secret"]["defaultMode"]
            target = self.root / "volumes" / mount["name"]
            for item in volume["secret"]["items"]:
                file = target / item["path"]
                file.parent.mkdir(parents=True, exist_ok=True)
                file.write_bytes(data[item["key"]])
                file.chmod(item.get("mode", mode))
        elif "persistentVolumeClaim" in volume:
            target = claims[volume["persistentVolumeClaim"]["claimName"]]
        elif "emptyDir" in volume and path in ("/tmp", "/dev/shm"):
            return  # the host's own, already private to this machine's processes
        else:
            raise AssertionError(f"the test does not know how to mount {volume}")
        self.mounts[path] = target
        if path.startswith(f"{IMAGE_WORKDIR}/"):  # seen through the working directory too
            (self.workdir / path.removeprefix(f"{IMAGE_WORKDIR}/")).symlink_to(target)

    def _path(self, value: str) -> str:
        """A path inside the container, as this test's host sees it."""
        for inside, outside in self.mounts.items():
            if value == inside or value.startswith(f"{inside}/"):
                return str(outside) + value[len(inside) :]
            if re.match(r"--[a-z-]+=", value) and f"={inside}" in value:
                flag, rest = value.split("=", 1)
                return f"{flag}={self._path(rest)}"
        return value

    def _expand(self, values: list[str]) -> list[str]:
        """Kubernetes' ``$(VAR)`` expansion in command and args."""
        return [re.sub(r"\$\((\w+)\)", lambda m: self.env.get(m[1], m[0]), v) for v in values]

    def _environment(self, extra: dict[str, str]) -> dict[str, str]:
        keep = ("PATH", "PYTHONPATH", "HOME", "LANG", "TMPDIR")
        env = {k: v for k, v in os.environ.items() if k in keep}
        env.update({"PYTHONUNBUFFERED": "1", "HOSTNAME": self.name, **extra})
        for item in self.container.get("env", []):
            if "value" in item:
                env[item["name"]] = self._path(item["value"])
            elif item["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}:
                env[item["name"]] = self.host.address
            else:
                raise AssertionError(f"the test does not know how to fill in {item}")
        return env

    def start(self) -> None:
        command = list(self.argv)
        if command[0] == "epochal":  # the image's console script
            command = [sys.executable, "-m", "epochal", *command[1:]]
        elif command[0] == "python":
            command[0] = sys.executable
        # a private mount namespace whose /etc/hosts is the pod's, as kubelet writes one
        setup = 'mount --bind "$0" /etc/hosts && cd "$1" && shift && exec "$@"'
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", setup]
        sink = self.log.open("ab")
        self.proc = self.host.popen(
            [*argv, str(self.hosts), str(self.workdir), *command],
            env=self.env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
        sink.close()

    def wait(self, deadline: float) -> tuple[int, str]:
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            pytest.fail(f"pod {self.name} ran past {deadline} s:\n{self.output()}")
        return code, self.output()

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def generate_keys(directory: Path) -> dict[str, dict[str, bytes]]:
    """The three Secrets, made as the README's commands make them: the CURVE keys from
    `epochal keys generate`, the checkpoint key from 32 random bytes in hex."""
    subprocess.run(
        [sys.executable, "-m", "epochal", "keys", "generate", "--name", "worker", str(directory)],
        check=True,
        capture_output=True,
    )
    return {
        "epochal-coordinator-keys": {
            "coordinator.key_secret": (directory / "coordinator.key_secret").read_bytes(),
            "worker.key": (directory / "allowed" / "worker.key").read_bytes(),
        },
        "epochal-worker-keys": {
            "coordinator.key": (directory / "coordinator.key").read_bytes(),
            "worker.key_secret": (directory / "workers" / "worker.key_secret").read_bytes(),
        },
        "epochal-checkpoint-key": {"checkpoint.key": (token_hex(32) + "\n").encode()},
    }


def probe(host: netns.Host, address: str, port: int) -> bool:
    """The readiness probe's tcpSocket check, from another host."""
    code = f"import socket; socket.create_connection(({address!r}, {port}), timeout=2).close()"
    done = subprocess.run(
        host.exec_argv([sys.executable, "-c", code]), capture_output=True, timeout=30
    )
    return done.returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(int(RUN_DEADLINE) + 120)
def test_the_manifests_run_as_pods_on_three_hosts_and_train_digits(tmp_path: Path) -> None:
    reason = netns.available() or (
        None if shutil.which("unshare") else "unshare (util-linux) is missing"
    )
    if reason is not None:
        pytest.skip(reason)
    found = resources()
    service = found["Service/epochal-coordinator"]
    statefulset = found["StatefulSet/epochal-coordinator"]
    job = found["Job/epochal-workers"]
    secrets = generate_keys(tmp_path / "keys")
    claims = {"epochal-runs": tmp_path / "pvc"}
    claims["epochal-runs"].mkdir()
    port = service["spec"]["ports"][0]["port"]
    with netns.hosts(1 + job["spec"]["completions"]) as net:
        coordinator_ip = net[0].address
        name = service["metadata"]["name"]
        pod0 = f"{statefulset['metadata']['name']}-0"
        # hostnames resolve to loopback, as in many images; the Service resolves to the pod IP
        hosts_file = (
            f"127.0.0.1 localhost\n127.0.1.1 {socket.gethostname()}\n"
            f"{coordinator_ip} {name} {pod0}.{name}\n"
        )
        workers = [
            Pod(
                f"{job['metadata']['name']}-{index}",
                job,
                net[1 + index],
                tmp_path,
                secrets,
                claims,
                hosts_file,
                {"JOB_COMPLETION_INDEX": str(index)},
            )
            for index in range(job["spec"]["completions"])
        ]
        coordinator = Pod(pod0, statefulset, net[0], tmp_path, secrets, claims, hosts_file, {})
        for secret in (tmp_path / pod0 / "volumes" / "keys").rglob("*.key*"):
            assert secret.stat().st_mode & 0o777 == 0o400
        # workers first: they wait for a coordinator that is not there yet, as pods may
        for pod in workers:
            pod.start()
        assert not probe(net[1], coordinator_ip, port), "nothing listens yet: not Ready"
        coordinator.start()
        deadline = time.monotonic() + 120
        while not probe(net[1], coordinator_ip, port):
            assert coordinator.proc is not None and coordinator.proc.poll() is None, (
                coordinator.output()
            )
            assert time.monotonic() < deadline, coordinator.output()
            time.sleep(0.5)

        code, log = coordinator.wait(RUN_DEADLINE)
        outputs = [pod.wait(120) for pod in workers]
        everything = log + "".join(out for _, out in outputs)
        assert code == 0, everything
        assert all(c == 0 for c, _ in outputs), everything
        epochs = int(
            option(statefulset["spec"]["template"]["spec"]["containers"][0]["args"], "--epochs")
        )
        assert f"finished after {epochs} epochs" in log, log
        # bound to 0.0.0.0 with a loopback hostname and no default route: the hint names the pod IP
        assert f"EPOCHAL_COORDINATOR=tcp://{coordinator_ip}:{port} " in log, log
        # the Indexed Job's completion index is the rank; rank 0 reports the test accuracy
        accuracy = re.search(r"test accuracy ([0-9.]+)", outputs[0][1])
        assert accuracy is not None and float(accuracy.group(1)) > 0.9, outputs[0][1]
        for index, pod in enumerate(workers):
            assert f"data plane at {pod.host.address}" in log, log
            assert f"rank {index}: " in log, log
        run_dir = claims["epochal-runs"] / option(
            statefulset["spec"]["template"]["spec"]["containers"][0]["args"], "--run-dir"
        ).removeprefix("runs/")
        assert (run_dir / "result.json").exists()
        assert list((run_dir / "checkpoints").iterdir()), "checkpoints on the shared volume"
        # signed with the mounted key, not with one made in a home directory
        key = CheckpointKey(
            secret=bytes.fromhex(secrets["epochal-checkpoint-key"]["checkpoint.key"].decode()),
            path=Path("checkpoint.key"),
        )
        for manifest in (run_dir / "checkpoints").glob("epoch-*/MANIFEST.json"):
            assert json.loads(manifest.read_text())["key_id"] == key.key_id
        net.close()
        assert not net.leftover()
