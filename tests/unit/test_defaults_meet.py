"""Every client's default address is where the server it talks to listens by default.

An operator who leaves an address out gets a working pair, never a client
dialling a port nobody serves (the connector once defaulted to 8100 while the
gateway listens on 8302: misses forever, one warning).
"""

from __future__ import annotations

import re

from kvmesh.cli.status import DEFAULT_COORDINATOR
from kvmesh.connector.vllm.settings import DEFAULT_GATEWAY, parse_settings
from kvmesh.coordinator.config import CoordinatorConfig
from kvmesh.gateway.config import GatewayConfig
from kvmesh.node.config import NodeConfig
from kvmesh.storage.config import StorageConfig
from tests.support.harness import REPO_ROOT


def _listens(config: object) -> str:
    return f"{config.host}:{config.port}"  # type: ignore[attr-defined]


def test_the_connector_dials_the_gateway_and_the_node_by_default() -> None:
    assert parse_settings(None).gateway == DEFAULT_GATEWAY
    assert _listens(GatewayConfig()) == DEFAULT_GATEWAY
    # kvmesh node serves the gateway (and storage) on one port: the same default.
    assert _listens(NodeConfig()) == DEFAULT_GATEWAY


def test_the_gateway_dials_the_storage_node_by_default() -> None:
    assert GatewayConfig().storage_target == _listens(StorageConfig())


def test_kvmesh_status_dials_the_coordinator_by_default() -> None:
    assert _listens(CoordinatorConfig()) == DEFAULT_COORDINATOR


def test_the_three_services_default_to_three_ports() -> None:
    ports = {c().port for c in (CoordinatorConfig, StorageConfig, GatewayConfig)}
    assert len(ports) == 3


def test_the_connectors_documented_example_uses_the_default_gateway() -> None:
    """The module docstring operators copy from names the address that works."""
    text = (REPO_ROOT / "src/kvmesh/connector/vllm/connector.py").read_text()
    examples = re.findall(r'"gateway":\s*"([^"]+)"', text)
    assert examples
    assert set(examples) == {DEFAULT_GATEWAY}
