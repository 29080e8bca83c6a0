"""The directory is a hint: a peer that dies, restarts or evicted the keys ends as a clean miss.

Real processes throughout (coordinator, nodes A and B); the crash is SIGKILL.
SIGSTOP/SIGCONT hold a process at a chosen step (never a sleep); keys really
deleted on A after the directory answered are in ``test_p2p_evicted.py``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from kvmesh.api.coordinator.v1 import ingest_pb2
from kvmesh.coordinator.client import EventIngestClient
from tests.integration.coordinator.support import batch, entry
from tests.integration.p2p.conftest import Fleet, running_fleet
from tests.integration.p2p.support import (
    MIB,
    PeerNode,
    WideEngine,
    fetch_spans,
    wait_in_directory,
)
from tests.integration.storage.support import CHUNK_BYTES, blocks_of, new_hashes, object_keys
from tests.support.waiting import wait_until


def _pid(node: PeerNode) -> int:
    assert node.proc.proc is not None
    return node.proc.proc.pid


def test_concurrent_lookups_of_one_prefix_fetch_it_once(tmp_path: Path, shm_root: Path) -> None:
    # B's lookup timeout is long: A is held stopped until every lookup is inside a fetch.
    with running_fleet(tmp_path, shm_root, b_args=("--p2p-lookup-timeout", "60")) as fleet:
        a, b = fleet.a, fleet.b
        hashes = new_hashes(5)
        a.store(hashes)
        wait_in_directory(fleet.coordinator.target, hashes, a.status().instance_id)
        before = b.status().p2p
        # A stops answering: the first fetch waits in its LockPrefix on A, so the
        # three lookups overlap for sure; the two later ones must join it.
        os.kill(_pid(a), signal.SIGSTOP)
        replies: list[Any] = []
        threads = [
            threading.Thread(target=lambda: replies.append(b.lookup(hashes))) for _ in range(3)
        ]
        try:
            for t in threads:
                t.start()
            wait_until(
                lambda: b.status().p2p.joined_fetches - before.joined_fetches == 2,
                timeout=60,
                message="the later lookups never joined the running fetch",
            )
        finally:
            os.kill(_pid(a), signal.SIGCONT)
        for t in threads:
            t.join(60)
        assert sorted(r.result.hit_chunks for r in replies) == [5, 5, 5]
        after = b.status().p2p
        assert after.fetches - before.fetches == 1  # one lock asked of A ...
        assert after.joined_fetches - before.joined_fetches == 2  # ... two joined it
        assert after.directory_lookups - before.directory_lookups == 1
        assert after.fetched_chunks - before.fetched_chunks == 5
        assert a.status().p2p.leases_granted == 1
        assert a.status().p2p.served_chunks == 5
        for reply in replies:  # each lookup's lease holds its own lock on the fetched chunks
            b.lease_id = reply.prefetch_id
            assert b.retrieve(hashes) == 5
        wait_until(lambda: b.read_locked() == 0 and a.read_locked() == 0, timeout=10)


def test_peer_killed_mid_transfer_leaves_whole_chunks_only_and_no_lock(
    tmp_path: Path, shm_root: Path, trace_file: Path
) -> None:
    """SIGKILL of A after B received some, not all, of the prefix's bytes."""
    chunks = 64
    total = chunks * WideEngine.CHUNK_BYTES  # 128 MiB: hundreds of 64 KiB frames
    big_l1 = ("--l1-size-bytes", str(192 * MIB))
    b_args = (
        *big_l1,
        "--p2p-frame-bytes", str(64 * 1024),
        "--p2p-lookup-timeout", "60",
        "--p2p-load-timeout", "120",
    )  # fmt: skip
    with running_fleet(tmp_path, shm_root, wide=True, a_args=big_l1, b_args=b_args) as fleet:
        a, b = fleet.a, fleet.b
        hashes = new_hashes(chunks)
        assert a.store(hashes) == [1] * chunks
        wait_in_directory(fleet.coordinator.target, hashes, a.status().instance_id)
        first_incarnation = a.status().incarnation
        pid = _pid(a)
        # A runs only in short slices between the test's questions to B, and is stopped
        # whenever the test decides: once B has received a byte, A is frozen in the
        # middle of the stream (far from its end: the rest is 100+ MiB), then killed.
        os.kill(pid, signal.SIGSTOP)
        replies: list[Any] = []
        asker = threading.Thread(target=lambda: replies.append(b.lookup(hashes, wait_ms=60_000)))
        asker.start()

        def some_bytes_arrived() -> bool:
            # A runs a millisecond at a time and B is asked while A is stopped: however
            # long B takes to answer (a loaded CI host), A never gets to send it all.
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.001)
            os.kill(pid, signal.SIGSTOP)
            return b.status().p2p.received_bytes > 0

        try:
            wait_until(
                some_bytes_arrived,
                timeout=120,
                interval=0.001,
                message="B never received a byte from A",
            )
        finally:
            a.proc.kill()  # SIGKILL (a stopped process dies too)
        asker.join(90)
        assert replies, "B's lookup never answered"
        reply = replies[0]
        assert reply.completed  # answered within its wait: a miss or a shorter hit
        hit = reply.result.hit_chunks
        assert hit < chunks
        status = b.status()
        assert 0 < status.p2p.received_bytes < total  # truly mid-transfer
        assert status.p2p.fetched_bytes == hit * WideEngine.CHUNK_BYTES
        assert status.p2p.fetch_failures >= 1
        assert status.l1.staging_objects == 0
        assert status.l1.resident_objects == hit  # only whole chunks were kept
        if hit:
            # No torn chunk: every chunk B reports holds A's bytes exactly.
            b.engine.fill(blocks_of(range(hit)), 0.0)
            assert b.retrieve(hashes[:hit]) == hit
            assert b.engine.blocks_bytes(blocks_of(range(hit))) == a.engine.blocks_bytes(
                blocks_of(range(hit))
            )
        wait_until(lambda: b.read_locked() == 0, timeout=10, message="a lock is left on B")
        # The fetch's span says it failed, and why.
        span = wait_until(
            lambda: next((s for s in fetch_spans(trace_file) if s["status"] == "ERROR"), None),
            timeout=30,
            message="no failed kvmesh.p2p.fetch span was exported",
        )
        assert span["attributes"]["kvmesh.p2p.outcome"] == "failed"
        assert span["attributes"]["kvmesh.p2p.chunks_fetched"] == hit
        assert any(e["name"] == "exception" for e in span.get("events", []))

        # A restarts: a new incarnation, with no lease and no lock left.
        a.proc.start()
        a.connect()
        restarted = a.status()
        assert restarted.incarnation > first_incarnation
        assert restarted.p2p.active_leases == 0
        assert restarted.l1.read_locked_objects == 0


def test_peer_killed_during_the_fetch_is_a_clean_miss_and_leaves_no_lock(
    fleet: Fleet, trace_file: Path
) -> None:
    a, b = fleet.a, fleet.b
    hashes = new_hashes(4)
    a.store(hashes)
    restarted_id = a.status().instance_id
    wait_in_directory(fleet.coordinator.target, hashes, restarted_id)
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
    # The fetch's span records the failure: ERROR status, the exception as an event.
    span = wait_until(
        lambda: next((s for s in fetch_spans(trace_file) if s["status"] == "ERROR"), None),
        timeout=30,
        message="no failed kvmesh.p2p.fetch span was exported",
    )
    assert span["attributes"]["kvmesh.p2p.outcome"] == "failed"
    assert span["attributes"]["kvmesh.p2p.peer"] == restarted_id
    assert "failed" in span["status_message"]
    assert any(e["name"] == "exception" for e in span.get("events", []))

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
