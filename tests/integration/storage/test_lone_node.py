"""A node alone in its fleet (a real coordinator process) answers an idle miss in the lookup.

The node has its own disk L2, whose index is complete, so only peers could
hold a chunk it lacks.
The P2P membership listing is refreshed in the background, so however long the
node sat idle, a lookup's miss ends on the node's event loop without a P2P
thread or a coordinator call (docs/p2p.md).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvmesh.bench.node_figures import parse
from kvmesh.storage.peers.links import MEMBERSHIP_TTL_S
from tests.integration.coordinator.support import CliProcess
from tests.integration.p2p.support import coordinator_args
from tests.integration.storage.conftest import NodeFactory
from tests.integration.storage.support import Engine, Node, new_hashes
from tests.support.ports import free_port
from tests.support.waiting import wait_until


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[CliProcess]:
    proc = CliProcess("coordinator", free_port(), coordinator_args(tmp_path))
    proc.start()
    try:
        yield proc
    finally:
        proc.kill()


def counters(node: Node) -> tuple[float, float]:
    """(lookups answered by the index, P2P fetches that ended as a miss)."""
    registry = CollectorRegistry()
    for collector in node.app.collectors():
        registry.register(collector)
    samples = parse(generate_latest(registry).decode())

    def total(name: str) -> float:
        return sum(v for (n, _), v in samples.items() if n == name)

    return total("kvmesh_storage_lookups_by_index_total"), total("kvmesh_storage_p2p_misses_total")


@pytest.mark.parametrize("refresh", [0.25, 0.0])
def test_an_idle_lone_node_answers_a_miss_within_the_lookup(
    make_node: NodeFactory, engine: Engine, coordinator: CliProcess, refresh: float
) -> None:
    node = make_node(
        l2=["disk"], coordinator_target=coordinator.target, p2p_membership_refresh=refresh
    )
    node.register(engine)
    assert node.app.peers.fetcher is not None  # P2P is on
    # Listed by a first miss (or the refresher), then idle past the listing's lifetime.
    node.lookup(new_hashes(1), wait_ms=5000)
    time.sleep(MEMBERSHIP_TTL_S * 1.5)
    before = counters(node)
    response = node.lookup(new_hashes(2), wait_ms=5000)
    assert response.completed
    assert response.result.hit_chunks == 0
    by_index, p2p_misses = (a - b for a, b in zip(counters(node), before, strict=True))
    if refresh:
        assert (by_index, p2p_misses) == (1, 0)  # fresh listing: no P2P thread, no listing
    else:
        assert (by_index, p2p_misses) == (0, 1)  # expired: the P2P path listed the members


def test_while_the_coordinator_is_down_a_miss_does_not_wait_for_it(
    make_node: NodeFactory, engine: Engine, coordinator: CliProcess
) -> None:
    """No coordinator, no directory to find a peer in: the poll's failure says so at once,
    and each miss ends in the lookup instead of waiting for a listing to fail."""
    node = make_node(l2=["disk"], coordinator_target=coordinator.target)
    node.register(engine)
    fetcher = node.app.peers.fetcher
    assert fetcher is not None
    wait_until(lambda: fetcher.directory.cached_peers() is not None, timeout=10)
    coordinator.kill()  # SIGKILL
    wait_until(lambda: fetcher.directory.cached_peers() == {}, timeout=10)
    assert fetcher.known_peers() == 0  # what GetStatus reports
    before = counters(node)
    for _ in range(3):
        response = node.lookup(new_hashes(2), wait_ms=5000)
        assert response.completed
        assert response.result.hit_chunks == 0
    by_index, p2p_misses = (a - b for a, b in zip(counters(node), before, strict=True))
    assert (by_index, p2p_misses) == (3, 0)
