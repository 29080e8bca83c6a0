"""Fixtures of the end-to-end tests: a real local fleet (child processes) and engines on it.

The fleet is :class:`kvmesh.cli.fleet.Fleet` — coordinator, storage and gateway
processes exactly as ``kvmesh up`` runs them. Engines run in the test process
with their KV cache in /dev/shm, registered with a gateway.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import torch

from kvmesh.cli.fleet import Fleet
from kvmesh.engine import Engine, EngineConfig
from tests.e2e.support import MODEL, start_fleet


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    # Two OpenMP threads competing with the fleet's processes for two cores are far
    # slower than one; the tests assert exactness, never speed.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One node (disk L2 by default) shared by the module's tests."""
    running = start_fleet(tmp_path_factory.mktemp("fleet"))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def engine(fleet: Fleet) -> Iterator[Engine]:
    """An engine registered with node 0's gateway, on its local lane (an engine on its host)."""
    config = EngineConfig(
        model=MODEL, num_blocks=512, gateway=fleet.endpoint("node-0-gateway", "lane")
    )
    with Engine(config) as eng:
        yield eng


@pytest.fixture(scope="module")
def reference() -> Iterator[Engine]:
    """The same model without kvmesh: what every cache hit is compared against."""
    with Engine(EngineConfig(model=MODEL, num_blocks=512)) as eng:
        yield eng


@pytest.fixture
def salt() -> str:
    """A cache salt of this test's own, so tests never see each other's chunks."""
    return f"e2e-{uuid.uuid4().hex[:12]}"
