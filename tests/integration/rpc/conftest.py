"""Fixtures of the local lane's tests: a short socket directory, a lane serving slow Health."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.rpc.lane.server import LaneServer
from tests.integration.rpc.lane_support import SlowHealth, running_slow_lane, socket_dir
from tests.support.harness import ServerThread


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with socket_dir() as path:
        yield path


@pytest.fixture
def slow_lane(sock_dir: Path) -> Iterator[tuple[ServerThread, LaneServer, SlowHealth]]:
    with running_slow_lane(sock_dir) as running:
        yield running
