"""examples/kvmesh.yaml loads through the real config loader for every service.

Each service reads its own section (the same file configures the whole fleet),
every key is a setting the service knows, and the values arrive converted
(sizes, lists, targets) — with nothing taken from the environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvmesh.cli.main import SERVICES, ServiceCommand
from kvmesh.common.config import resolve
from tests.support.harness import REPO_ROOT

EXAMPLE = REPO_ROOT / "examples" / "kvmesh.yaml"


def _load(command: ServiceCommand) -> Any:
    return resolve(command.load(command.config), command.name, environ={}, yaml_path=EXAMPLE)


def test_the_example_has_a_section_for_every_service() -> None:
    sections = yaml.safe_load(EXAMPLE.read_text())
    assert set(sections) == {c.name for c in SERVICES}


@pytest.mark.parametrize("command", SERVICES, ids=lambda c: c.name)
def test_every_service_loads_its_section(command: ServiceCommand) -> None:
    settings = _load(command)
    section = yaml.safe_load(EXAMPLE.read_text())[command.name]
    for key in section:
        assert hasattr(settings, key), key
    assert settings.port == section["port"]
    assert settings.metrics_port == section["metrics_port"]


def test_the_values_arrive_converted() -> None:
    by_name = {c.name: c for c in SERVICES}
    storage = _load(by_name["storage"])
    assert storage.l1_size_bytes == 1 << 30
    assert storage.l2 == ["disk"]
    assert storage.coordinator_target == "127.0.0.1:8300"
    gateway = _load(by_name["gateway"])
    assert gateway.storage_target == f"lane:{storage.lane_socket}"
    coordinator = _load(by_name["coordinator"])
    assert coordinator.chunk_size == gateway.chunk_size == 256
    assert Path(coordinator.checkpoint_path).name == "checkpoint.bin"
    node = _load(by_name["node"])
    assert node.instance_id == storage.instance_id == "node-a"
