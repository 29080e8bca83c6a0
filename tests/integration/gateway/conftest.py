"""Fixtures: a real storage node with a real gateway in front of it, and engines.

Every test gets its own directory under /dev/shm (the node's L1 segments in
``l1/``, engine KV files in ``engine/``, which is also the node's allowed
directory) and its own instance id and data directory; all of it is removed
afterwards, also when the test fails.

Transport arrangements. A stack is deployed in one of four arrangements (see
:func:`arrangement`). A test runs under the default one, storage and gateway
as two servers over gRPC (``kvmesh storage`` + ``kvmesh gateway``, as
docker-compose deploys them), unless it is marked ``@pytest.mark.transports``:
then it runs under all four. Mark a test whose outcome can depend on the
transport or on the gateway's storage link: cancellation, deadlines, errors
relayed or turned into status codes, parked waits, and the few tests that
together make every NodeStorage call once. ``KVMESH_GATEWAY_ARRANGEMENTS=all``
runs every test under all four (after a change to a link or a transport).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvmesh.gateway.app import GatewayApp
from kvmesh.gateway.client import GatewayClient
from kvmesh.gateway.config import GatewayConfig
from kvmesh.node.app import NodeApp, NodeConfig
from kvmesh.rpc.server import Server
from kvmesh.storage.app import StorageApp
from kvmesh.storage.config import StorageConfig
from tests.integration.gateway.support import CHUNK, Engine, Node, Stack
from tests.support.harness import ServerThread, server_thread

MIB = 1 << 20


@dataclass
class ShmDirs:
    """This test's directories under /dev/shm."""

    root: Path
    l1: Path
    engine: Path


@pytest.fixture
def shm_dirs() -> Iterator[ShmDirs]:
    root = Path("/dev/shm") / f"kvmesh-gw-it-{uuid.uuid4().hex[:12]}"
    dirs = ShmDirs(root, root / "l1", root / "engine")
    dirs.l1.mkdir(parents=True)
    dirs.engine.mkdir()
    try:
        yield dirs
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def thread() -> Iterator[ServerThread]:
    """The event loop the servers of one test run on (every server stopped at the end)."""
    with server_thread() as t:
        yield t


StackFactory = Callable[..., Stack]


ARRANGEMENTS = ("separate", "node", "lane", "separate-lane")
#: What users run by default: two servers, every hop over gRPC.
DEFAULT_ARRANGEMENT = "separate"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "transports: transport-sensitive; run under every gateway/storage arrangement",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``arrangement`` over every arrangement for tests marked ``transports``."""
    if "arrangement" not in metafunc.fixturenames:
        return
    every = os.environ.get("KVMESH_GATEWAY_ARRANGEMENTS") == "all"
    if every or metafunc.definition.get_closest_marker("transports") is not None:
        metafunc.parametrize("arrangement", ARRANGEMENTS, indirect=True)


@pytest.fixture
def arrangement(request: pytest.FixtureRequest) -> str:
    """Gateway and storage as two servers (gRPC link), or one ``kvmesh node`` (in-process
    link); ``lane`` is that node with the engine's client on the local lane instead of gRPC,
    ``separate-lane`` the two servers with the lane on both hops (engine -> gateway ->
    storage). :data:`DEFAULT_ARRANGEMENT` unless the test is marked ``transports``.
    """
    return str(getattr(request, "param", DEFAULT_ARRANGEMENT))


@pytest.fixture
def make_stack(
    thread: ServerThread, shm_dirs: ShmDirs, tmp_path: Path, arrangement: str
) -> Iterator[StackFactory]:
    """Start nodes: ``make_stack(storage={"l2": ["disk"]}, gateway={"session_ttl_seconds": 1})``.

    ``storage_target`` in the gateway overrides points a gateway at another
    (or no) storage server; ``node=`` reuses a running storage node. Under the
    ``node`` arrangement a fresh stack is one NodeApp serving both services.
    """
    stacks: list[Stack] = []

    def start(
        *,
        storage: dict[str, Any] | None = None,
        gateway: dict[str, Any] | None = None,
        node: Node | None = None,
    ) -> Stack:
        colocated = (
            arrangement in ("node", "lane")
            and node is None
            and "storage_target" not in (gateway or {})
        )
        lane: dict[str, Any] = {}
        if arrangement in ("lane", "separate-lane"):
            lane["lane_socket"] = str(shm_dirs.root / f"lane{len(stacks)}.sock")
        if node is None:
            settings: dict[str, Any] = {
                "port": 0,
                "metrics_port": -1,
                "grace_seconds": 0.2,
                "instance_id": f"gw-it-{uuid.uuid4().hex[:12]}",
                "data_dir": str(tmp_path / f"node{len(stacks)}"),
                "l1_size_bytes": 16 * MIB,
                "l1_segment_bytes": 4 * MIB,
                "shm_dir": str(shm_dirs.l1),
                "allowed_memory_dir": str(shm_dirs.engine),
                "l2": ["none"],
            }
            settings.update(storage or {})
            if colocated:
                merged = {**settings, "chunk_size": CHUNK, **lane, **(gateway or {})}
                server = thread.start(NodeConfig(**merged), NodeApp)
                stack = Stack(Node(thread, server), server, GatewayClient(_target(server)))
                stacks.append(stack)
                return stack
            if arrangement == "separate-lane":
                settings["lane_socket"] = str(shm_dirs.root / f"storage{len(stacks)}.sock")
            node = Node(thread, thread.start(StorageConfig(**settings), StorageApp))
        gw_settings: dict[str, Any] = {
            "port": 0,
            "metrics_port": -1,
            "grace_seconds": 0.2,
            "storage_target": _target(node.server),
            "chunk_size": CHUNK,
        }
        gw_settings.update(lane)
        gw_settings.update(gateway or {})
        server = thread.start(GatewayConfig(**gw_settings), GatewayApp)
        stack = Stack(node, server, GatewayClient(_target(server)))
        stacks.append(stack)
        return stack

    try:
        yield start
    finally:
        closed: set[int] = set()
        for stack in stacks:
            stack.client.close()
            if id(stack.node) not in closed:
                closed.add(id(stack.node))
                stack.node.close()


def _target(server: Server) -> str:
    """What the engine's client dials: the local lane when the server has one."""
    return server.lane.target if server.lane is not None else server.target


@pytest.fixture
def make_engine(shm_dirs: ShmDirs) -> Iterator[Callable[..., Engine]]:
    """Engine KV files (not registered): ``make_engine(seed=1)``."""
    engines: list[Engine] = []

    def create(seed: int = 0) -> Engine:
        eng = Engine(shm_dirs.engine, f"engine-{uuid.uuid4().hex[:8]}", seed=seed)
        engines.append(eng)
        return eng

    try:
        yield create
    finally:
        for eng in engines:
            eng.close()


@pytest.fixture
def engine(make_engine: Callable[..., Engine]) -> Engine:
    """One engine's KV cache file (not registered yet)."""
    return make_engine()


@pytest.fixture
def stack(make_stack: StackFactory) -> Stack:
    """A node without L2 behind a gateway with chunk size 64."""
    return make_stack()


@pytest.fixture
def ready(stack: Stack, engine: Engine) -> Stack:
    """``stack`` with ``engine`` registered as worker 0 of world size 1."""
    stack.register(engine)
    return stack
