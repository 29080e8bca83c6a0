"""A node that stops cleanly leaves nothing of its L1 in the coordinator's directory.

The node reports what its stop still stored before it deregisters: events
that reached the coordinator after the deregistration would put back L1
placements of a node the coordinator has dropped, where no sweep reaches
them, and routers and peers would be sent to it.
"""

from __future__ import annotations

from pathlib import Path

from kvmesh.api.coordinator.v1 import directory_pb2
from kvmesh.coordinator.client import DirectoryClient
from tests.integration.p2p.conftest import running_fleet
from tests.integration.storage.support import new_hashes, object_keys


def test_a_node_stopped_right_after_a_store_leaves_no_placement_behind(
    tmp_path: Path, shm_root: Path
) -> None:
    # A holds its events for 5 s: the stop finds the store's still unsent.
    with running_fleet(tmp_path, shm_root, a_args=["--event-flush-ms", "5000"]) as fleet:
        a = fleet.a
        instance = a.status().instance_id
        hashes = new_hashes(4)
        assert a.store(hashes) == [1] * 4
        a.close()
        a.proc.stop()
        with DirectoryClient(fleet.coordinator.target) as directory:
            response = directory.lookup(
                directory_pb2.LookupRequest(keys=directory_pb2.KeyList(keys=object_keys(hashes)))
            )
    placed = [p for r in response.results for p in r.placements if p.instance_id == instance]
    assert placed == []
