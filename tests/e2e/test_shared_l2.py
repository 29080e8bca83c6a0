"""A second node that shares only the L2 backend serves a prefix the first node computed.

Its own fleet (two nodes whose storages share one Redis L2), in a module of
its own: fleets on one host must not overlap (their storage instances share
names, and with them L1 shared-memory names).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.cli.fleet import Fleet
from kvmesh.engine import Engine, EngineConfig
from tests.e2e.support import (
    L1,
    L2,
    MODEL,
    require_fleet_services,
    run_prompt,
    same_output,
    start_fleet,
    stored_chunks,
    tokens,
)
from tests.support.waiting import wait_until


@pytest.fixture
def two_nodes_sharing_redis(tmp_path: Path, redis_server: object) -> Iterator[Fleet]:
    """Two nodes whose storages share one Redis L2 (and nothing else)."""
    require_fleet_services()
    l2 = json.dumps(
        {
            "type": "redis",
            "url": redis_server.url,  # type: ignore[attr-defined]
            "key_prefix": f"kvmesh-e2e-{uuid.uuid4().hex[:8]}:",
            "shared": True,
        }
    )
    running = start_fleet(tmp_path, nodes=2, extra_storage_args=["--l2", l2])
    try:
        yield running
    finally:
        running.stop()


def test_a_second_node_sharing_only_the_l2_backend_serves_the_prefix(
    two_nodes_sharing_redis: Fleet, reference: Engine, salt: str
) -> None:
    fleet = two_nodes_sharing_redis
    prompt = tokens(1100, seed=7)

    def engine_on(node: int) -> Engine:
        return Engine(
            EngineConfig(
                model=MODEL, num_blocks=256, gateway=fleet.endpoint(f"node-{node}-gateway")
            )
        )

    with engine_on(0) as first:
        cold = run_prompt(first, prompt, salt)
    wait_until(lambda: stored_chunks(fleet.endpoint("node-0-storage"), L2, salt) == 4, timeout=60)
    assert stored_chunks(fleet.endpoint("node-1-storage"), L1, salt) == 0

    with engine_on(1) as second:
        warm = run_prompt(second, prompt, salt)

    assert (warm.tokens_from_cache, warm.lookup_l2_hit_chunks) == (1024, 4)
    assert same_output(warm, cold)
    assert same_output(warm, run_prompt(reference, prompt, ""))
