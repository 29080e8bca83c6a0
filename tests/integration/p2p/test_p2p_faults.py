"""The directory is a hint: a peer that dies, restarts or evicted the keys ends as a clean miss.

Real processes throughout (coordinator, nodes A and B); the crash is SIGKILL.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from kvmesh.api.coordinator.v1 import ingest_pb2
from kvmesh.coordinator.client import EventIngestClient
from tests.integration.coordinator.support import batch, entry
from tests.integration.p2p.conftest import Fleet
from tests.integration.p2p.support import wait_in_directory
from tests.integration.storage.support import CHUNK_BYTES, new_hashes, object_keys
from tests.support.waiting import wait_until


def test_concurrent_lookups_of_one_prefix_fetch_it_once(fleet: Fleet) -> None:
    a, b = fleet.a, fleet.b
    hashes = new_hashes(5)
    a.store(hashes)
    wait_in_directory(fleet.coordinator.target, hashes, a.status().instance_id)
    replies: list[Any] = []
    threads = [threading.Thread(target=lambda: replies.append(b.lookup(hashes))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(r.result.hit_chunks for r in replies) == [5, 5, 5]
    assert a.status().p2p.leases_granted == 1
    assert a.status().p2p.served_chunks == 5


def test_peer_killed_during_the_fetch_is_a_clean_miss_and_leaves_no_lock(fleet: Fleet) -> None:
    a, b = fleet.a, fleet.b
    hashes = new_hashes(4)
    a.store(hashes)
    wait_in_directory(fleet.coordinator.target, hashes, a.status().instance_id)
    first_incarnation = a.status().incarnation
    # A stops answering (still in the directory and membership), B's fetch reaches it,
    # then A dies for good.
    assert a.proc.proc is not None
    os.kill(a.proc.proc.pid, signal.SIGSTOP)
    replies: list[Any] = []
    asker = threading.Thread(target=lambda: replies.append(b.lookup(hashes)))
    asker.start()
    wait_until(lambda: b.status().p2p.fetches >= 1, timeout=20, message="B never asked A")
    a.proc.kill()
    asker.join(60)
    assert replies
    assert replies[0].completed
    assert replies[0].result.hit_chunks == 0
    status = b.status()
    assert status.l1.read_locked_objects == 0
    assert status.l1.staging_objects == 0
    assert status.l1.resident_objects == 0
    assert status.p2p.fetch_failures >= 1

    # A restarts (same port and data dir): a new incarnation, no lock left, and its
    # old L1 placements are fenced: B misses cleanly, fast, and retrieves nothing.
    a.proc.start()
    a.connect()
    restarted = a.status()
    assert restarted.incarnation > first_incarnation
    assert restarted.l1.read_locked_objects == 0
    assert restarted.p2p.active_leases == 0
    reply = b.lookup(hashes)
    assert reply.completed
    assert reply.result.hit_chunks == 0
    assert b.read_locked() == 0


def test_keys_gone_from_the_peer_after_the_directory_answered_are_a_clean_miss(
    fleet: Fleet,
) -> None:
    a, b = fleet.a, fleet.b
    hashes = new_hashes(3)
    # The directory says A holds the keys (as if A had evicted them since reporting:
    # a placement injected with A's identity, past A's own sequence), A does not.
    status = a.status()
    with EventIngestClient(fleet.coordinator.target) as ingest:
        ingest.ingest_batches(
            ingest_pb2.IngestBatchesRequest(
                batches=[
                    batch(
                        status.instance_id,
                        seq=status.emitter.last_seq + 1_000_000,
                        incarnation=status.incarnation,
                        entries=[entry(k, CHUNK_BYTES) for k in object_keys(hashes)],
                    )
                ]
            )
        )
    wait_in_directory(fleet.coordinator.target, hashes, status.instance_id)
    reply = b.lookup(hashes)
    assert reply.completed
    assert reply.result.hit_chunks == 0
    assert a.status().p2p.leases_granted == 0  # A locked nothing: nothing to lease
    assert b.read_locked() == 0
    assert a.read_locked() == 0
    assert b.status().l1.staging_objects == 0


def test_a_shorter_prefix_on_the_peer_gives_a_shorter_hit(fleet: Fleet) -> None:
    a, b = fleet.a, fleet.b
    hashes = new_hashes(5)
    a.store(hashes[:3])
    wait_in_directory(fleet.coordinator.target, hashes[:3], a.status().instance_id)
    reply = b.lookup(hashes)
    assert reply.completed
    assert reply.result.hit_chunks == 3
    assert b.retrieve(hashes[:3]) == 3
    wait_until(lambda: b.read_locked() == 0 and a.read_locked() == 0, timeout=10)


def test_two_tenants_salts_never_cross(fleet: Fleet) -> None:
    a, b = fleet.a, fleet.b
    hashes = new_hashes(3)
    a.store(hashes, salt="tenant-a")
    wait_in_directory(fleet.coordinator.target, hashes, a.status().instance_id, salt="tenant-a")
    other = b.lookup(hashes, salt="tenant-b")
    assert other.completed
    assert other.result.hit_chunks == 0
    plain = b.lookup(hashes)  # no salt: the default tenant
    assert plain.completed
    assert plain.result.hit_chunks == 0
    assert a.status().p2p.leases_granted == 0
    owner = b.lookup(hashes, salt="tenant-a")
    assert owner.completed
    assert owner.result.hit_chunks == 3
    assert b.retrieve(hashes, salt="tenant-a") == 3


def test_p2p_can_be_turned_off(fleet: Fleet, tmp_path: Any) -> None:
    a, b = fleet.a, fleet.b
    hashes = new_hashes(2)
    a.store(hashes)
    wait_in_directory(fleet.coordinator.target, hashes, a.status().instance_id)
    b.close()
    b.proc.stop()
    b.proc.args.append("--no-p2p")
    b.proc.start()
    b.connect()
    b.register()
    started = time.monotonic()
    reply = b.lookup(hashes)
    assert reply.completed
    assert reply.result.hit_chunks == 0
    assert not b.status().p2p.enabled
    assert a.status().p2p.leases_granted == 0
    assert time.monotonic() - started < 60  # bounded: a hang would fail the harness first
