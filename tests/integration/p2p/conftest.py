"""Fixtures: a coordinator and two storage nodes (A and B) as real processes, no shared L2."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.coordinator.support import CliProcess
from tests.integration.p2p.support import PeerNode, coordinator_args, storage_args
from tests.integration.storage.support import Engine
from tests.support.harness import free_port


@dataclass
class Fleet:
    coordinator: CliProcess
    a: PeerNode
    b: PeerNode
    shm_root: Path


@pytest.fixture
def shm_root() -> Iterator[Path]:
    root = Path("/dev/shm") / f"kvmesh-p2p-{uuid.uuid4().hex[:12]}"
    (root / "engine").mkdir(parents=True)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def make_node(
    name: str, tmp_path: Path, shm_root: Path, coordinator: str, seed: int, *extra: str
) -> PeerNode:
    proc = CliProcess(
        "storage", free_port(), storage_args(tmp_path, shm_root, name, coordinator, *extra)
    )
    return PeerNode(name, proc, Engine(shm_root / "engine", f"engine-{name}", seed=seed))


@pytest.fixture
def fleet(tmp_path: Path, shm_root: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Fleet]:
    """Coordinator + nodes A and B, started, engines registered; every span they make is
    appended to ``tmp_path / "spans.jsonl"``. Tests that need other node flags restart a
    node themselves."""
    monkeypatch.setenv("KVMESH_TRACE_FILE", str(tmp_path / "spans.jsonl"))
    coordinator = CliProcess("coordinator", free_port(), coordinator_args(tmp_path))
    nodes: list[PeerNode] = []
    try:
        coordinator.start()
        for name, seed in (("a", 1), ("b", 2)):
            node = make_node(name, tmp_path, shm_root, coordinator.target, seed)
            nodes.append(node)
            node.proc.start()
            node.connect()
            node.register()
        yield Fleet(coordinator, nodes[0], nodes[1], shm_root)
    finally:
        for node in nodes:
            node.close()
            node.proc.kill()
            node.engine.close()
        coordinator.kill()
