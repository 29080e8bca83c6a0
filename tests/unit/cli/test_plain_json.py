"""``--json`` outputs: 64-bit integers are JSON numbers, keys snake_case, well-known types kept."""

from __future__ import annotations

import json

from kvmesh.api.coordinator.v1 import admin_pb2, directory_pb2, membership_pb2
from kvmesh.cli.plainjson import plain
from kvmesh.cli.status import as_json


def test_int64_fields_maps_and_defaults_are_plain_numbers() -> None:
    stats = directory_pb2.GetStatsResponse(
        num_keys=2**40, l1_size_bytes=7, l1_keys_by_instance={"node-a": 2**35}
    )
    data = plain(stats)
    assert data["num_keys"] == 2**40
    assert data["l1_size_bytes"] == 7
    assert data["l2_placements"] == 0  # a default is printed, as a number
    assert data["l1_keys_by_instance"] == {"node-a": 2**35}
    # Round-trips through JSON as numbers, not strings.
    assert '"num_keys": 1099511627776' in json.dumps(data)


def test_timestamps_keep_their_json_form() -> None:
    status = admin_pb2.GetStatusResponse(batches_admitted=3)
    status.started_at.FromSeconds(1_700_000_000)
    data = plain(status)
    assert data["batches_admitted"] == 3
    assert data["started_at"] == "2023-11-14T22:13:20Z"


def test_status_sections_are_one_level_deep() -> None:
    instances = membership_pb2.ListInstancesResponse()
    instances.instances.add(instance_id="node-0")
    out = as_json(
        {
            "instances": instances,
            "cursors": directory_pb2.ListIngestCursorsResponse(),
            "stats": directory_pb2.GetStatsResponse(num_keys=5),
        }
    )
    assert [i["instance_id"] for i in out["instances"]] == ["node-0"]
    assert out["cursors"] == []
    assert out["stats"]["num_keys"] == 5
