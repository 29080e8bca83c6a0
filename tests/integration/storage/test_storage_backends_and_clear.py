"""StorageService: deletes name the node's own backends per tier; Clear never loses a stored chunk.

* DeleteKeys' backend is one of the node's backends: "dram" for L1, an L2
  adapter by name; with TIER_ALL an L2 name limits the L2 part and "dram"
  leaves L2 alone; a backend the tier does not have is INVALID_ARGUMENT
  naming what the node has.
* Clear(force) while L2 write-through is still queued (a slow memory L2):
  every chunk a store reported stored still reaches L2, and the L1 objects
  are dropped.
"""

from __future__ import annotations

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.storage.v1 import storage_pb2
from tests.integration.storage.conftest import NodeFactory
from tests.integration.storage.support import Engine, Node, chunk_blocks, new_hashes, object_keys
from tests.support.waiting import wait_until

L1 = common_pb2.TIER_L1
L2 = common_pb2.TIER_L2
ALL = common_pb2.TIER_ALL
STORED = storage_pb2.STORE_OUTCOME_STORED


def blocks_of(chunks: range) -> list[int]:
    return [b for c in chunks for b in chunk_blocks(c)]


def per_backend(node: Node) -> dict[str, set[bytes]]:
    out: dict[str, set[bytes]] = {"dram": set(), "disk": set(), "memory": set()}
    for o in node.listing(ALL):
        out[o.backend].add(o.key.chunk_hash)
    return out


def test_deletes_name_the_nodes_own_backends_per_tier(
    make_node: NodeFactory, engine: Engine
) -> None:
    node = make_node(l2=["disk", '{"type": "memory"}'])
    node.register(engine)
    h = new_hashes(8)
    node.store(engine, h, blocks_of(range(8)))
    every = set(h)
    node.wait_written_through(h)
    assert per_backend(node) == {"dram": every, "disk": every, "memory": every}

    # L1 by its backend name (what the coordinator sends for an L1 placement).
    assert node.delete(h[0:2], L1, backend="dram") == (2, 0)
    # L2 by one adapter, and by every adapter.
    assert node.delete(h[2:4], L2, backend="memory") == (2, 0)
    assert node.delete(h[4:5], L2) == (2, 0)  # one key, two adapters
    # Both tiers: "dram" leaves L2 alone; an L2 name limits the L2 part only.
    assert node.delete(h[5:6], ALL, backend="dram") == (1, 0)
    assert node.delete(h[6:7], ALL, backend="disk") == (2, 0)
    assert node.delete(h[7:8], ALL) == (3, 0)
    assert per_backend(node) == {
        "dram": {h[2], h[3], h[4]},
        "disk": {h[0], h[1], h[2], h[3], h[5]},
        "memory": {h[0], h[1], h[5], h[6]},
    }

    # A backend the tier does not have is refused, naming what the node has.
    for tier, backend in ((L1, "disk"), (L2, "dram"), (ALL, "redis")):
        error = node.error(
            "delete_keys",
            storage_pb2.DeleteKeysRequest(keys=object_keys(h[2:3]), tier=tier, backend=backend),
        )
        assert error.code().name == "INVALID_ARGUMENT"
        assert f"{backend!r}" in str(error.details())
        assert "L1 ['dram'] and L2 ['disk', 'memory']" in str(error.details())
    assert h[2] in per_backend(node)["dram"]


def test_clear_while_write_through_is_queued_loses_no_stored_chunk(
    make_node: NodeFactory, engine: Engine
) -> None:
    # Every put_many call of this L2 takes a second: the first store's batch is
    # being written while the second store's chunks wait in the queue.
    node = make_node(l2=['{"type": "memory", "latency_s": 1.0}'])
    node.register(engine)
    first, second, third = new_hashes(4), new_hashes(3), new_hashes(2)
    assert node.store(engine, first, blocks_of(range(4))) == [STORED] * 4
    assert node.store(engine, second, blocks_of(range(4, 7))) == [STORED] * 3
    owed = len(first) + len(second) - len(node.l2_hashes())
    assert owed > 0, "every write-through finished before the Clear; the test proves nothing"

    cleared = node.call("clear", storage_pb2.ClearRequest(force=True))
    assert cleared.cleared_objects == 7
    assert node.l1_hashes() == set()
    # Nothing Store reported stored was lost: the queued chunks were written first.
    assert node.l2_hashes() == set(first) | set(second)

    assert node.store(engine, third, blocks_of(range(7, 9))) == [STORED] * 2
    every = set(first) | set(second) | set(third)
    wait_until(lambda: node.l2_hashes() == every, timeout=30)
    # The adapter shows a key before the controller thread counts its batch.
    wait_until(lambda: node.app.manager.status()["store"]["stored_keys"] >= 9, timeout=30)
    store = node.app.manager.status()["store"]
    assert (store["missing_keys"], store["dropped_keys"], store["stored_keys"]) == (0, 0, 9)
