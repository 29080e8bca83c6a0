"""An engine on node 1 of ``kvmesh up --nodes 2 --l2 none`` gets node 0's prefix through P2P.

The fleet has no L2 at all, so a prefix one node computed can reach the other
only node to node. The engine is kvmesh's small real transformer behind the
gateway (the gateway API is unchanged: the P2P fetch is an ordinary hit), and
its output must equal the cold run bit for bit.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.cli import fleetfile
from kvmesh.cli.fleet import Fleet
from kvmesh.cli.status import node_links, render_links
from kvmesh.engine import Engine, EngineConfig
from tests.e2e.support import (
    L1,
    MODEL,
    placed_in_directory,
    run_prompt,
    same_output,
    start_fleet,
    stored_chunks,
    tokens,
)
from tests.support.waiting import wait_until


@pytest.fixture
def fleet_without_l2(tmp_path: Path) -> Iterator[Fleet]:
    running = start_fleet(tmp_path, nodes=2, l2=["none"])
    try:
        yield running
    finally:
        running.stop()


def test_an_engine_on_node_1_gets_node_0s_prefix_through_p2p(fleet_without_l2: Fleet) -> None:
    fleet = fleet_without_l2
    salt = f"p2p-{uuid.uuid4().hex[:8]}"
    prompt = tokens(1100, seed=11)

    def engine_on(node: int) -> Engine:
        return Engine(
            EngineConfig(
                model=MODEL, num_blocks=256, gateway=fleet.endpoint(f"node-{node}-gateway")
            )
        )

    with engine_on(0) as first:
        cold = run_prompt(first, prompt, salt)
    assert cold.tokens_from_cache == 0
    wait_until(lambda: stored_chunks(fleet.endpoint("node-0-storage"), L1, salt) == 4, timeout=60)
    assert stored_chunks(fleet.endpoint("node-1-storage"), L1, salt) == 0
    # The directory learns node 0's chunks through its event stream; node 1 asked
    # before that would miss, compute the prompt and hold it itself.
    wait_until(
        lambda: placed_in_directory(
            fleet.endpoint("coordinator"), fleet.endpoint("node-0-storage"), salt
        ),
        timeout=60,
        message="the directory never placed node 0's chunks",
    )
    with engine_on(1) as second:
        warm = run_prompt(second, prompt, salt)
    assert warm.tokens_from_cache == 1024
    assert same_output(warm, cold)
    # Node 1 now holds the prefix itself (an ordinary store, reported as such).
    assert stored_chunks(fleet.endpoint("node-1-storage"), L1, salt) == 4
    # kvmesh status shows the traffic per node: node 1 fetched 4 chunks, node 0 served them.
    links = {link["node"]: link for link in node_links(fleetfile.record(fleet), 5.0)}
    assert int(links["node-1"]["p2p"]["fetched_chunks"]) == 4
    assert int(links["node-0"]["p2p"]["served_chunks"]) == 4
    table = render_links(list(links.values()))
    assert "tcp-stream" in table
    assert "P2P in / out" in table
    # And each node's engines and sessions, from its gateway's metrics: the engines
    # unregistered as they closed, nothing was reaped, no session stayed open.
    assert links["node-1"]["gateway"] == {
        "engines": 0, "engines_reaped": 0, "reregistrations": 0, "live_owners": 0, "sessions": 0,
    }  # fmt: skip
    assert "engines (reaped, re-registered) / sessions" in table
    assert links["node-1"]["leases"]["active"] == links["node-1"]["leases"]["held_locks"] == 0
