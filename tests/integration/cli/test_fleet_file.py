"""``kvmesh up`` leaves a fleet file; ``status`` (and ``demo``) find the fleet through it.

Also: ``up`` hands ``--l2``, ``--config`` and ``--log-level`` to its services,
and a storage node that cannot reach its coordinator says so in ``kvmesh
status`` even when the coordinator itself is unreachable.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.cli import fleetfile
from kvmesh.cli.demo import _running_gateway
from tests.support.harness import REPO_ROOT
from tests.support.ports import free_port
from tests.support.waiting import wait_until


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[dict[str, object], dict[str, str]]]:
    config = tmp_path / "fleet.yaml"
    config.write_text("storage:\n  eviction_watermark: 0.7\ngateway:\n  max_tokens: 50000\n")
    env = dict(os.environ, KVMESH_FLEET_FILE=str(tmp_path / "fleet.json"))
    env.pop("KVMESH_COORDINATOR", None)
    up = subprocess.Popen(
        [
            sys.executable, "-m", "kvmesh.cli", "up", "--l1-size", "16MiB",
            "--l2", "none", "--config", str(config), "--log-level", "debug",
            "--data-dir", str(tmp_path / "data"),
        ],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_until(lambda: (tmp_path / "fleet.json").exists() or up.poll() is not None, timeout=90)
        assert up.poll() is None, f"kvmesh up exited with {up.returncode}"
        yield json.loads((tmp_path / "fleet.json").read_text()), env
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
    assert not (tmp_path / "fleet.json").exists()


def test_status_finds_the_fleet_through_the_fleet_file(
    fleet: tuple[dict[str, object], dict[str, str]], tmp_path: Path
) -> None:
    record, env = fleet
    nodes = record["nodes"]
    assert isinstance(nodes, list)
    assert [n["name"] for n in nodes] == ["node-0"]
    assert record["coordinator"]
    assert nodes[0]["gateway"]
    assert nodes[0]["gateway_lane"].startswith("lane:")

    status = _cli("status", env=env)
    assert status.returncode == 0, status.stderr
    assert f"coordinator {record['coordinator']}" in status.stdout
    assert "Nodes of the fleet file" in status.stdout
    section = status.stdout.split("Nodes of the fleet file", 1)[1]
    link = next(line for line in section.splitlines() if line.startswith("node-0 "))
    # Columns: node, storage, coordinator link, P2P in / out.
    assert " connected " in link, link
    assert "NOT" not in link, link
    assert "[tcp-stream]" in link, link

    # The services got --l2, --config and --log-level (their DEBUG config lines).
    log = (tmp_path / "data" / "logs" / "node-0-storage.log").read_text()
    assert "config: l2 = ['none']" in log
    assert "config: eviction_watermark = 0.7" in log
    assert "config: log_level = 'DEBUG'" in log
    gateway_log = (tmp_path / "data" / "logs" / "node-0-gateway.log").read_text()
    assert "config: max_tokens = 50000" in gateway_log


def test_demo_uses_the_running_fleet_by_default(
    fleet: tuple[dict[str, object], dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    record, env = fleet
    monkeypatch.setenv(fleetfile.FLEET_FILE_ENV, env[fleetfile.FLEET_FILE_ENV])
    nodes = record["nodes"]
    assert isinstance(nodes, list)
    assert _running_gateway() == (nodes[0]["gateway_lane"], env[fleetfile.FLEET_FILE_ENV])


def test_status_shows_a_node_that_cannot_reach_its_coordinator(tmp_path: Path) -> None:
    coordinator = f"127.0.0.1:{free_port()}"  # nothing listens there
    ready = tmp_path / "ready.json"
    shm_dir = Path("/dev/shm") / f"kvmesh-test-status-{uuid.uuid4().hex[:10]}"
    storage = subprocess.Popen(
        [
            sys.executable, "-m", "kvmesh.cli", "storage", "--port", "0",
            "--metrics-port", "-1", "--coordinator-target", coordinator,
            "--instance-id", f"lonely-{uuid.uuid4().hex[:8]}",
            "--data-dir", str(tmp_path / "data"), "--shm-dir", str(shm_dir),
            "--l1-size-bytes", "8MiB", "--ready-file", str(ready),
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_until(lambda: ready.exists() or storage.poll() is not None, timeout=60)
        assert storage.poll() is None
        address = json.loads(ready.read_text())["grpc"]
        # A fleet file as kvmesh up writes it (this test process stands in for up).
        fleet_file = tmp_path / "fleet.json"
        fleetfile.write(
            fleet_file,
            {
                "pid": os.getpid(),
                "coordinator": coordinator,
                "nodes": [{"name": "node-0", "storage": address, "gateway": ""}],
            },
        )
        env = dict(os.environ, KVMESH_FLEET_FILE=str(fleet_file))
        env.pop("KVMESH_COORDINATOR", None)
        status = _cli("status", "--timeout", "2", env=env)
    finally:
        storage.send_signal(signal.SIGTERM)
        storage.wait(timeout=60)
        if shm_dir.exists():
            shm_dir.rmdir()
    assert status.returncode == 1
    first, *table = status.stderr.splitlines()
    assert first.startswith(f"kvmesh status: error: cannot reach the coordinator at {coordinator}")
    assert f"fleet file {fleet_file}" in first
    assert "--coordinator" in first
    assert "KVMESH_COORDINATOR" in first
    row = next(line for line in table if line.startswith("node-0 "))
    assert "NOT connected" in row


def test_two_fleets_of_one_user_keep_their_own_files(tmp_path: Path) -> None:
    """A second kvmesh up neither overwrites nor deletes the first one's fleet file."""
    registry = tmp_path / "fleets"
    env = dict(os.environ, KVMESH_FLEET_DIR=str(registry))
    env.pop(fleetfile.FLEET_FILE_ENV, None)
    env.pop("KVMESH_COORDINATOR", None)
    ups: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(2):
            up = subprocess.Popen(
                [sys.executable, "-m", "kvmesh.cli", "up", "--colocated", "--l1-size", "16MiB"],
                cwd=REPO_ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            ups.append(up)
            mine = registry / f"fleet-{up.pid}.json"
            wait_until(lambda: mine.exists() or up.poll() is not None, timeout=90)  # noqa: B023
            assert up.poll() is None, f"kvmesh up exited with {up.returncode}"
        first, second = (json.loads((registry / f"fleet-{u.pid}.json").read_text()) for u in ups)
        assert first["coordinator"] != second["coordinator"]

        status = _cli("status", env=env)
        assert status.returncode == 0, status.stderr
        assert f"coordinator {second['coordinator']}" in status.stdout
        assert "2 fleets are running; using the newest" in status.stderr
        assert f"fleet-{ups[0].pid}.json" in status.stderr

        ups[1].send_signal(signal.SIGTERM)
        assert ups[1].wait(timeout=60) == 0
        assert (registry / f"fleet-{ups[0].pid}.json").exists()
        status = _cli("status", env=env)
        assert status.returncode == 0, status.stderr
        assert f"coordinator {first['coordinator']}" in status.stdout
        assert "fleets are running" not in status.stderr
    finally:
        for up in ups:
            if up.poll() is None:
                up.send_signal(signal.SIGTERM)
                up.wait(timeout=60)
    assert not list(registry.glob("*.json"))
