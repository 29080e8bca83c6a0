"""AdminService over a real socket: Checkpoint and GetStatus; a clean restart restores state."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from kvmesh.api.coordinator.v1 import admin_pb2, policy_pb2
from tests.integration.coordinator.conftest import CHUNK, CoordFactory
from tests.integration.coordinator.support import L1, L2, Coord, batch, code_of, pkey, stores
from tests.support.waiting import wait_until


def test_checkpoint_without_a_path_is_failed_precondition(coord: Coord) -> None:
    with pytest.raises(grpc.RpcError) as info:
        coord.clients.admin.checkpoint(admin_pb2.CheckpointRequest())
    assert code_of(info.value) == grpc.StatusCode.FAILED_PRECONDITION
    status = coord.clients.admin.get_status(admin_pb2.GetStatusRequest())
    assert (status.checkpoint_path, status.HasField("last_checkpoint")) == ("", False)


def test_checkpoint_writes_the_file_and_status_reports_it(
    make_coord: CoordFactory, tmp_path: Path
) -> None:
    path = tmp_path / "state" / "coordinator.ckpt"
    coord = make_coord(checkpoint_path=str(path))
    c = coord.clients
    c.register("node-a")
    c.ingest_batches(
        batch("node-a", 1, tier=L1, entries=stores([1, 2])),
        batch("node-a", 1, tier=L1, entries=stores([3])),  # duplicate
    )
    node = coord.node("node-a")
    wait_until(lambda: coord.app.streams.connected("node-a"))
    status = c.admin.get_status(admin_pb2.GetStatusRequest())
    assert status.version
    assert status.started_at.seconds > 0
    assert (status.registered_instances, status.connected_streams) == (1, 1)
    assert (status.batches_admitted, status.batches_duplicate, status.batches_stale) == (1, 1, 0)
    assert (status.num_keys, status.chunk_size, status.restored) == (2, CHUNK, False)
    assert status.checkpoint_path == str(path)
    assert not status.HasField("last_checkpoint")
    wait_until(lambda: c.admin.get_status(admin_pb2.GetStatusRequest()).ready)
    response = c.admin.checkpoint(admin_pb2.CheckpointRequest())
    assert response.path == str(path)
    assert response.size_bytes == path.stat().st_size > 0
    assert {"stream_cursors", "key_directory"} <= set(response.sections)
    assert response.duration_seconds >= 0
    assert c.admin.get_status(admin_pb2.GetStatusRequest()).HasField("last_checkpoint")
    node.close()


def test_a_clean_restart_restores_directory_cursors_pins_and_quotas(
    make_coord: CoordFactory, tmp_path: Path
) -> None:
    paths = {
        "checkpoint_path": str(tmp_path / "ckpt"),
        "metadata_path": str(tmp_path / "meta.json"),
    }
    first = make_coord(**paths)
    c = first.clients
    c.ingest_batches(
        batch("node-a", 1, tier=L1, entries=stores([1])),
        batch("node-a", 2, tier=L2, entries=stores([2], salt="t")),
        batch("node-a", 4, tier=L2, entries=stores([4])),  # a gap
    )
    c.policy.set_quota(policy_pb2.SetQuotaRequest(cache_salt="t", tier=L2, limit_bytes=123))
    before = c.snapshot()
    first.stop()  # a clean stop writes the final checkpoint
    second = make_coord(**paths)
    c2 = second.clients
    assert c2.snapshot() == before
    assert c2.admin.get_status(admin_pb2.GetStatusRequest()).restored
    quota = c2.policy.get_quota(policy_pb2.GetQuotaRequest(cache_salt="t", tier=L2)).quota
    assert quota.limit_bytes == 123
    # The restored cursor still fences: a new incarnation drops the old L1.
    c2.ingest_batches(batch("node-a", 1, incarnation=2, tier=L1, entries=stores([5])))
    assert c2.placements(pkey(1)) == []
    assert c2.placements(pkey(2, salt="t")) == [("node-a", 1, L2, "disk", 100)]
