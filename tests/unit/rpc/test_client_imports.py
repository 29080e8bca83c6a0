"""Importing a typed client stays light: no server, no Prometheus, no YAML, no torch.

A vLLM connector imports ``kvmesh.gateway.client`` inside the engine's
process; it must not drag in the server side (health and reflection
services, Prometheus, the YAML config loader) or anything heavy. Each client
is imported in a fresh interpreter and its ``sys.modules`` inspected.

``import grpc`` itself imports the empty ``grpc_health`` and
``grpc_reflection`` packages (to alias them as ``grpc.health`` and
``grpc.reflection``) when they are installed; those two bare packages are
grpc's, so the check is on what the client adds to what ``import grpc``
loads.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.harness import REPO_ROOT

CLIENTS = ["kvmesh.gateway.client", "kvmesh.storage.client", "kvmesh.coordinator.client"]
FORBIDDEN = ("grpc_health", "grpc_reflection", "prometheus_client", "yaml", "torch")
# Server-side kvmesh modules (kvmesh.rpc.server, its interceptors, metrics, the lane's server).
SERVER_MODULES = ("kvmesh.rpc.server", "kvmesh.rpc.interceptors", "kvmesh.rpc.metrics")


def _modules_after(statement: str) -> set[str]:
    script = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return set(json.loads(done.stdout))


def _family(name: str, roots: tuple[str, ...]) -> bool:
    return any(name == root or name.startswith(root + ".") for root in roots)


@pytest.fixture(scope="module")
def grpc_baseline() -> set[str]:
    return _modules_after("import grpc")


@pytest.mark.parametrize("client", CLIENTS)
def test_importing_a_client_loads_no_server_side_or_heavy_module(
    client: str, grpc_baseline: set[str]
) -> None:
    loaded = _modules_after(f"import {client}")
    added = loaded - grpc_baseline
    assert sorted(m for m in added if _family(m, FORBIDDEN)) == []
    assert sorted(m for m in loaded if _family(m, SERVER_MODULES)) == []
    assert sorted(m for m in loaded if m.startswith("kvmesh.") and ".server" in m) == []
    # Of the service packages, only the client and the package __init__s.
    service = client.rsplit(".", 1)[0]
    services = ("kvmesh.gateway", "kvmesh.storage", "kvmesh.coordinator")
    assert sorted(m for m in loaded if _family(m, services) and m not in services) == [client]
    assert service in loaded


def test_the_baseline_is_only_grpcs_bare_packages(grpc_baseline: set[str]) -> None:
    """What ``import grpc`` brings of the forbidden families: their empty top packages at most."""
    assert {m for m in grpc_baseline if _family(m, FORBIDDEN)} <= {
        "grpc_health",
        "grpc_reflection",
    }


def test_importing_the_connector_loads_only_the_gateway_client(grpc_baseline: set[str]) -> None:
    """The connector runs inside the engine's processes: the gateway client, nothing heavier."""
    loaded = _modules_after("import kvmesh.connector")
    added = loaded - grpc_baseline
    assert sorted(m for m in added if _family(m, FORBIDDEN)) == []
    assert sorted(m for m in loaded if _family(m, SERVER_MODULES)) == []
    services = ("kvmesh.gateway", "kvmesh.storage", "kvmesh.coordinator")
    assert sorted(m for m in loaded if _family(m, services) and m not in services) == [
        "kvmesh.gateway.client"
    ]
