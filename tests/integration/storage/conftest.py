"""Fixtures: a real storage node (L2 none or disk) and a registered engine.

Every test gets its own shared-memory directory under /dev/shm (the node's
L1 segments in ``l1/``, engine files in ``engine/``, which is also the
node's allowed directory), its own instance id and data directory, and all
of it is removed afterwards, also when the test fails.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvmesh.storage.app import StorageApp
from kvmesh.storage.config import StorageConfig
from tests.integration.storage.support import Engine, Node
from tests.support.harness import server_thread

MIB = 1 << 20


@dataclass
class ShmDirs:
    """This test's directories under /dev/shm."""

    root: Path
    l1: Path
    engine: Path


@pytest.fixture
def shm_dirs() -> Iterator[ShmDirs]:
    root = Path("/dev/shm") / f"kvmesh-it-{uuid.uuid4().hex[:12]}"
    dirs = ShmDirs(root, root / "l1", root / "engine")
    dirs.l1.mkdir(parents=True)
    dirs.engine.mkdir()
    try:
        yield dirs
    finally:
        shutil.rmtree(root, ignore_errors=True)


NodeFactory = Callable[..., Node]


@pytest.fixture
def make_node(shm_dirs: ShmDirs, tmp_path: Path) -> Iterator[NodeFactory]:
    """Start storage nodes: ``make_node(l2=["disk"], max_message_bytes=..., ...)``."""
    with server_thread() as thread:
        nodes: list[Node] = []

        def start(**overrides: Any) -> Node:
            n = len(nodes)
            settings: dict[str, Any] = {
                "port": 0,
                "metrics_port": -1,
                "grace_seconds": 0.5,
                "instance_id": f"it-{uuid.uuid4().hex[:12]}",
                "data_dir": str(tmp_path / f"node{n}"),
                "l1_size_bytes": 64 * MIB,
                "l1_segment_bytes": 16 * MIB,
                "shm_dir": str(shm_dirs.l1),
                "allowed_memory_dir": str(shm_dirs.engine),
                "l2": ["none"],
                "max_chunks_per_request": 64,
            }
            settings.update(overrides)
            server = thread.start(StorageConfig(**settings), StorageApp)
            node = Node(thread, server)
            nodes.append(node)
            return node

        try:
            yield start
        finally:
            for node in nodes:
                node.close()
        # Leaving the block stopped every server: the pools removed their segments.


@pytest.fixture
def engine(shm_dirs: ShmDirs) -> Iterator[Engine]:
    """An engine's KV cache file (not registered yet)."""
    eng = Engine(shm_dirs.engine, f"engine-{uuid.uuid4().hex[:8]}")
    try:
        yield eng
    finally:
        eng.close()


@pytest.fixture
def node(make_node: NodeFactory, engine: Engine) -> Node:
    """A node without L2, with ``engine`` registered."""
    n = make_node()
    n.register(engine)
    return n


@pytest.fixture
def disk_node(make_node: NodeFactory, engine: Engine) -> Node:
    """A node with a disk L2 adapter (in the test's tmp dir), with ``engine`` registered."""
    n = make_node(l2=["disk"])
    n.register(engine)
    return n
