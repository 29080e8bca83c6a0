"""Engine-driven transactions of the StorageNode expire with their lock TTLs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvmesh.common.errors import Aborted, NotFound
from kvmesh.storage.core.l1.results import L1Result
from kvmesh.storage.core.manager import StorageManager
from kvmesh.storage.core.node import StorageNode
from kvmesh.storage.core.options import StorageOptions
from kvmesh.storage.core.transfer.engine import TransferEngine
from tests.unit.storage.helpers import MIB, FakeClock, make_key


@pytest.fixture
def node(shm_dir: str, clock: FakeClock) -> Iterator[StorageNode]:
    manager = StorageManager(
        "txn",
        8 * MIB,
        options=StorageOptions(
            segment_bytes=4 * MIB,
            shm_dir=shm_dir,
            background_threads=False,
            read_ttl_s=30.0,
            write_ttl_s=60.0,
        ),
        clock=clock,
    )
    transfer = TransferEngine(shm_dir)
    node = StorageNode(manager, transfer, clock=clock)
    try:
        yield node
    finally:
        manager.close()
        transfer.close()


def test_uncommitted_store_expires_after_the_write_ttl(node: StorageNode, clock: FakeClock) -> None:
    keys = [make_key(1), make_key(2)]
    txn, slots, _, _ = node.prepare_store(keys, 4096)
    assert len(slots) == 2
    clock.advance(59.0)
    assert node.expire_transactions() == 0
    clock.advance(2.0)
    assert node.expire_transactions() == 1
    with pytest.raises(NotFound):
        node.commit_store(txn)
    assert node.manager.l1.contains(keys) == [False, False]
    # The slots were given back: the same keys can be prepared again.
    txn2, slots2, _, _ = node.prepare_store(keys, 4096)
    assert len(slots2) == 2
    assert node.commit_store(txn2) == 2


def test_uncommitted_retrieve_expires_after_the_read_ttl(
    node: StorageNode, clock: FakeClock
) -> None:
    keys = [make_key(3)]
    txn, _, _, _ = node.prepare_store(keys, 4096)
    node.commit_store(txn)
    read, slots = node.prepare_retrieve(keys, 4096)
    assert len(slots) == 1
    clock.advance(31.0)
    assert node.expire_transactions() == 1
    with pytest.raises(NotFound):
        node.commit_retrieve(read, [])
    # The lapsed read lock no longer blocks a plain delete.
    assert node.delete(keys, None, "", False)[0] == 1


def test_a_retrieve_committed_after_its_locks_lapsed_is_aborted_and_releases_nothing(
    node: StorageNode, clock: FakeClock
) -> None:
    # The sweep has not come by yet; meanwhile the lock lapsed and a new reader
    # locked the chunk afresh. The late commit must neither report success (what the
    # engine read may have been overwritten) nor release the new reader's lock.
    keys = [make_key(5)]
    txn, _, _, _ = node.prepare_store(keys, 4096)
    node.commit_store(txn)
    read, slots = node.prepare_retrieve(keys, 4096)
    assert len(slots) == 1
    clock.advance(31.0)
    assert node.manager.reserve_read(keys, 1) == [L1Result.SUCCESS]
    with pytest.raises(Aborted, match="lapsed") as err:
        node.commit_retrieve(read, [])
    assert err.value.reason == "LOCKS_LAPSED"
    assert node.manager.l1.read_lock_count(keys[0]) == 1
    with pytest.raises(NotFound):
        node.commit_retrieve(read, [])
    assert node.expire_transactions() == 0
