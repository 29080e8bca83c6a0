"""StorageService over a real socket: the engine-driven path (prepare, then commit)."""

from __future__ import annotations

import numpy as np

from kvmesh.api.storage.v1 import storage_pb2
from tests.integration.storage.conftest import NodeFactory
from tests.integration.storage.support import (
    CHUNK_BYTES,
    Engine,
    Node,
    blocks_of,
    chunk_blocks,
    new_hashes,
    read_slot,
    row,
    write_slot,
)


def test_engine_driven_store_then_retrieve_moves_exact_bytes(node: Node) -> None:
    hashes = new_hashes(3)
    payloads = [np.random.default_rng(i).bytes(CHUNK_BYTES) for i in range(3)]
    prepared = node.call(
        "prepare_store", storage_pb2.PrepareStoreRequest(keys=row(hashes), chunk_bytes=CHUNK_BYTES)
    )
    assert prepared.transaction_id
    assert [s.chunk_index for s in prepared.slots] == [0, 1, 2]
    assert (prepared.already_cached_chunks, prepared.skipped_chunks) == (0, 0)
    for slot in prepared.slots:
        assert slot.region.size_bytes == CHUNK_BYTES
        write_slot(slot, payloads[slot.chunk_index])
    # Not readable before the commit.
    assert node.l1_hashes() == set()
    committed = node.call(
        "commit_store", storage_pb2.CommitStoreRequest(transaction_id=prepared.transaction_id)
    )
    assert committed.committed_chunks == 3
    assert node.l1_hashes() == set(hashes)

    again = node.call(
        "prepare_store",
        storage_pb2.PrepareStoreRequest(
            keys=row([*hashes[:1], *new_hashes(1)]), chunk_bytes=CHUNK_BYTES
        ),
    )
    assert again.already_cached_chunks == 1
    assert [s.chunk_index for s in again.slots] == [1]
    node.call("commit_store", storage_pb2.CommitStoreRequest(transaction_id=again.transaction_id))

    read = node.call(
        "prepare_retrieve",
        storage_pb2.PrepareRetrieveRequest(
            keys=row([*hashes, *new_hashes(1)]), chunk_bytes=CHUNK_BYTES
        ),
    )
    assert [s.chunk_index for s in read.slots] == [0, 1, 2]  # the resident prefix
    assert [read_slot(s) for s in read.slots] == payloads
    # Read-locked until the commit.
    assert node.read_locked_objects() == 3
    assert node.delete(hashes) == (0, 3)
    done = node.call(
        "commit_retrieve", storage_pb2.CommitRetrieveRequest(transaction_id=read.transaction_id)
    )
    assert done.released_chunks == 3
    assert node.read_locked_objects() == 0
    # A second commit of the same transaction releases nothing (the .proto: idempotent).
    repeat = node.call(
        "commit_retrieve", storage_pb2.CommitRetrieveRequest(transaction_id=read.transaction_id)
    )
    assert repeat.released_chunks == 0


def test_commit_retrieve_uses_up_its_leases_locks_on_the_chunks_it_read(
    node: Node, engine: Engine
) -> None:
    hashes = new_hashes(2)
    node.store(engine, hashes, blocks_of(range(2)))
    lease = node.lookup(hashes).prefetch_id
    read = node.call(
        "prepare_retrieve",
        storage_pb2.PrepareRetrieveRequest(keys=row(hashes[1:]), chunk_bytes=CHUNK_BYTES),
    )
    assert [read_slot(s) for s in read.slots] == [engine.chunk(chunk_blocks(1))]
    node.call(
        "commit_retrieve",
        storage_pb2.CommitRetrieveRequest(transaction_id=read.transaction_id, lease_id=lease),
    )
    assert node.delete(hashes) == (1, 1)
    assert node.l1_hashes() == {hashes[0]}


def test_engine_driven_chunks_are_retrievable_into_a_registered_engine(
    node: Node, engine: Engine
) -> None:
    # The two paths share L1: what one stores the other reads.
    hashes = new_hashes(1)
    payload = engine.chunk(chunk_blocks(3))
    prepared = node.call(
        "prepare_store", storage_pb2.PrepareStoreRequest(keys=row(hashes), chunk_bytes=CHUNK_BYTES)
    )
    write_slot(prepared.slots[0], payload)
    node.call(
        "commit_store", storage_pb2.CommitStoreRequest(transaction_id=prepared.transaction_id)
    )
    target = chunk_blocks(0, base=50)
    engine.fill(target, 0.0)
    assert node.retrieve(engine, hashes, target) == 1
    assert engine.blocks_bytes(target) == engine.blocks_bytes(chunk_blocks(3))


def test_prepare_store_when_nothing_fits_is_resource_exhausted(make_node: NodeFactory) -> None:
    node = make_node(l1_size_bytes=8 << 20, l1_segment_bytes=4 << 20)
    size = 4 << 20
    # Staging objects are never evictable: two fill the whole pool.
    first = node.call(
        "prepare_store", storage_pb2.PrepareStoreRequest(keys=row(new_hashes(2)), chunk_bytes=size)
    )
    assert len(first.slots) == 2
    error = node.error(
        "prepare_store", storage_pb2.PrepareStoreRequest(keys=row(new_hashes(1)), chunk_bytes=size)
    )
    assert error.code().name == "RESOURCE_EXHAUSTED"
    # The reservations survived the refusal (a full pool then evicts down to its watermark).
    committed = node.call(
        "commit_store", storage_pb2.CommitStoreRequest(transaction_id=first.transaction_id)
    )
    assert committed.committed_chunks == 2
