"""Fixtures: a coordinator and two storage nodes (A and B) as real processes, no shared L2."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.coordinator.support import CliProcess
from tests.integration.p2p.support import (
    PeerNode,
    WideEngine,
    coordinator_args,
    storage_args,
)
from tests.integration.storage.support import Engine
from tests.support.ports import free_port
from tests.support.waiting import wait_until


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
    name: str,
    tmp_path: Path,
    shm_root: Path,
    coordinator: str,
    seed: int,
    *extra: str,
    port: int | None = None,
    wide: bool = False,
    metrics: bool = False,
) -> PeerNode:
    """A node (not started): ``extra`` flags after the defaults (the last one wins);
    ``wide`` gives it a :class:`WideEngine`; ``metrics`` serves its /metrics."""
    metrics_port = free_port() if metrics else -1
    flags = [*extra, *(("--metrics-port", str(metrics_port)) if metrics else ())]
    proc = CliProcess(
        "storage", port or free_port(), storage_args(tmp_path, shm_root, name, coordinator, *flags)
    )
    directory = shm_root / "engine"
    engine = (
        WideEngine(directory, f"engine-{name}", seed=seed)
        if wide
        else Engine(directory, f"engine-{name}", seed=seed)
    )
    return PeerNode(name, proc, engine, metrics_port=metrics_port)


@contextmanager
def running_fleet(
    tmp_path: Path,
    shm_root: Path,
    *,
    a_args: Sequence[str] = (),
    b_args: Sequence[str] = (),
    a_port: int | None = None,
    wide: bool = False,
    b_metrics: bool = False,
    coordinator_extra: Sequence[str] = (),
) -> Iterator[Fleet]:
    """Coordinator + nodes A and B, started, engines registered (node flags appended)."""
    coordinator = CliProcess(
        "coordinator", free_port(), [*coordinator_args(tmp_path), *coordinator_extra]
    )
    nodes: list[PeerNode] = []
    try:
        coordinator.start()
        for name, seed, extra, port, metrics in (
            ("a", 1, a_args, a_port, False),
            ("b", 2, b_args, None, b_metrics),
        ):
            node = make_node(
                name,
                tmp_path,
                shm_root,
                coordinator.target,
                seed,
                *extra,
                port=port,
                wide=wide,
                metrics=metrics,
            )
            nodes.append(node)
            node.proc.start(wait=False)  # both nodes start side by side
        for node in nodes:
            node.proc.wait_serving()  # the finally below kills both if one fails
            node.connect()
            node.register()
        # Nodes list the members in the background (docs/p2p.md): wait until each one
        # that fetches knows the other, so a test's first miss already sees its peer.
        for node, extra in zip(nodes, (a_args, b_args), strict=True):
            if "--no-p2p" not in extra and "--p2p-membership-refresh" not in extra:
                wait_until(lambda n=node: n.status().p2p.peers >= 1, timeout=30)  # type: ignore[misc]
        yield Fleet(coordinator, nodes[0], nodes[1], shm_root)
    finally:
        for node in nodes:
            node.close()
            node.proc.kill()
            node.engine.close()
        coordinator.kill()


@pytest.fixture
def trace_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every span the processes started from now on make is appended here."""
    path = tmp_path / "spans.jsonl"
    monkeypatch.setenv("KVMESH_TRACE_FILE", str(path))
    return path


@pytest.fixture
def fleet(tmp_path: Path, shm_root: Path, trace_file: Path) -> Iterator[Fleet]:
    """Coordinator + nodes A and B, started, engines registered; every span they make is
    appended to ``tmp_path / "spans.jsonl"``. Tests that need other node flags start
    their own with :func:`running_fleet`."""
    with running_fleet(tmp_path, shm_root) as running:
        yield running
