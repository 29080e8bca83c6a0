"""P2P fetch on a local miss, between real storage processes and a real coordinator."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tests.integration.p2p.conftest import Fleet
from tests.integration.p2p.support import read_spans, wait_in_directory
from tests.integration.storage.support import blocks_of, new_hashes
from tests.support.waiting import wait_until


def _instance(node: object) -> str:
    return str(node.status().instance_id)  # type: ignore[attr-defined]


def test_node_b_gets_node_a_prefix_with_equal_bytes(fleet: Fleet, tmp_path: Path) -> None:
    a, b = fleet.a, fleet.b
    hashes = new_hashes(6)
    assert a.store(hashes) == [1] * 6  # STORED
    wait_in_directory(fleet.coordinator.target, hashes, _instance(a))

    reply = b.lookup(hashes)
    assert reply.completed
    assert reply.result.hit_chunks == 6, b.proc.log()

    b.engine.fill(blocks_of(range(6), 20), 0.0)
    assert b.retrieve(hashes, base=20) == 6
    assert np.array_equal(
        np.asarray(b.engine.kv[:, :, blocks_of(range(6), 20)]),
        np.asarray(a.engine.kv[:, :, blocks_of(range(6))]),
    )
    # No lock left on either side; B now holds the chunks as ordinary L1 objects,
    # and its events report them to the coordinator.
    wait_until(lambda: b.read_locked() == 0 and a.read_locked() == 0, timeout=10)
    wait_in_directory(fleet.coordinator.target, hashes, _instance(b))
    status = b.status().p2p
    assert status.enabled
    assert status.peers == 1  # A, in the listing B keeps fresh
    assert status.transport == "tcp-stream"
    assert status.fetched_chunks == 6
    assert a.status().p2p.served_chunks == 6

    # One trace span per fetch on B (naming the peer), and A's PeerService calls.
    spans_file = tmp_path / "spans.jsonl"

    def spans() -> list[dict[str, Any]]:
        return read_spans(spans_file)

    def fetch_span() -> dict[str, Any] | None:
        return next((s for s in spans() if s.get("name") == "kvmesh.p2p.fetch"), None)

    span = wait_until(fetch_span, timeout=30, message="no kvmesh.p2p.fetch span was exported")
    assert span["attributes"]["kvmesh.p2p.peer"] == _instance(a)
    assert span["attributes"]["kvmesh.p2p.chunks_fetched"] == 6
    assert span["attributes"]["kvmesh.p2p.outcome"] == "hit"
    assert span["status"] != "ERROR"  # failures set ERROR (see test_p2p_faults.py)
    names = {s.get("name") for s in spans()}
    wait_until(
        lambda: "/kvmesh.storage.v1.PeerService/LockPrefix" in {s.get("name") for s in spans()},
        timeout=30,
        message=f"no PeerService span among {sorted(n for n in names if n)}",
    )
