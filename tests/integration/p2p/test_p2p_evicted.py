"""Keys really deleted on node A after the directory sent B there: a clean miss, no lock left.

Real processes (coordinator, nodes A and B). A advertises a :class:`TcpProxy`
in front of its port, so B's PeerService calls to A pass through the test:
holding one direction of the proxy freezes B's fetch at a chosen step (after
B read the directory, before A locks; or after A granted the lease, before B
reads it) while A itself, the coordinator and the test's calls run on. The
deletion is A's own StorageService DeleteKeys on L1 (what an eviction does to
the keys), not a forged directory entry.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.integration.p2p.conftest import Fleet, running_fleet
from tests.integration.p2p.support import TcpProxy, fetch_spans, wait_in_directory
from tests.integration.storage.support import new_hashes
from tests.support.ports import free_port
from tests.support.waiting import wait_until


@dataclass
class ProxiedFleet:
    fleet: Fleet
    proxy: TcpProxy  # in front of A: every B -> A PeerService call passes here
    warm: list[bytes]  # chunks B already fetched from A (the path through the proxy works)


@pytest.fixture
def proxied(tmp_path: Path, shm_root: Path, trace_file: Path) -> Iterator[ProxiedFleet]:
    a_port = free_port()
    proxy = TcpProxy(f"127.0.0.1:{a_port}")
    try:
        with running_fleet(
            tmp_path,
            shm_root,
            a_port=a_port,
            a_args=("--advertise-address", proxy.address),
            b_args=("--p2p-lookup-timeout", "60"),  # a held call must not time out
            b_metrics=True,
        ) as fleet:
            a, b = fleet.a, fleet.b
            assert a.status().p2p.advertise_address == proxy.address
            # One fetch through the proxy first: B's connection to A is up and used.
            warm = new_hashes(2)
            a.store(warm, base=40)
            wait_in_directory(fleet.coordinator.target, warm, a.status().instance_id)
            reply = b.lookup(warm)
            assert reply.result.hit_chunks == 2
            assert b.retrieve(warm) == 2
            wait_until(lambda: b.read_locked() == 0 and a.read_locked() == 0, timeout=10)
            yield ProxiedFleet(fleet, proxy, warm)
    finally:
        proxy.close()


def _ask(node: Any, hashes: list[bytes], replies: list[Any]) -> threading.Thread:
    thread = threading.Thread(target=lambda: replies.append(node.lookup(hashes)))
    thread.start()
    return thread


def test_keys_deleted_on_the_peer_after_the_directory_answered_are_a_clean_miss(
    proxied: ProxiedFleet, trace_file: Path
) -> None:
    fleet, proxy = proxied.fleet, proxied.proxy
    a, b = fleet.a, fleet.b
    hashes = new_hashes(3)
    assert a.store(hashes) == [1] * 3
    wait_in_directory(fleet.coordinator.target, hashes, a.status().instance_id)
    before_b, before_a = b.status().p2p, a.status().p2p

    proxy.to_upstream.clear()  # B's LockPrefix will wait in front of A
    replies: list[Any] = []
    try:
        asker = _ask(b, hashes, replies)
        # B read the directory (A holds the keys), picked A and is locking there.
        wait_until(
            lambda: b.status().p2p.fetches == before_b.fetches + 1,
            timeout=30,
            message="B never went to A",
        )
        # Now the keys leave A for real (an eviction of them), before A sees the lock.
        assert a.delete(hashes) == 3
        assert a.status().l1.resident_objects == len(proxied.warm)
    finally:
        proxy.to_upstream.set()
    asker.join(60)

    assert replies
    assert replies[0].completed
    assert replies[0].result.hit_chunks == 0  # a clean miss
    status = b.status()
    assert status.p2p.misses == before_b.misses + 1
    assert status.p2p.fetch_failures == before_b.fetch_failures
    assert status.p2p.received_bytes == before_b.received_bytes
    assert status.l1.read_locked_objects == 0
    assert status.l1.staging_objects == 0
    assert status.l1.resident_objects == len(proxied.warm)  # nothing of the new keys
    after_a = a.status()
    assert after_a.p2p.leases_granted == before_a.leases_granted  # A locked nothing
    assert after_a.p2p.active_leases == 0
    assert after_a.l1.read_locked_objects == 0
    # The misses are a Prometheus counter too.
    assert b.metric("kvmesh_storage_p2p_misses_total") == status.p2p.misses == 1
    assert b.metric("kvmesh_storage_p2p_received_bytes_total") == status.p2p.received_bytes
    # The fetch's span: a miss, not a failure.
    span = wait_until(
        lambda: next(
            (
                s
                for s in fetch_spans(trace_file)
                if s.get("attributes", {}).get("kvmesh.p2p.outcome") == "miss"
            ),
            None,
        ),
        timeout=30,
        message="no kvmesh.p2p.fetch span with outcome miss",
    )
    assert span["status"] != "ERROR"


def test_keys_force_deleted_while_leased_end_the_stream_and_free_the_lease(
    proxied: ProxiedFleet,
) -> None:
    fleet, proxy = proxied.fleet, proxied.proxy
    a, b = fleet.a, fleet.b
    used_before = a.status().l1.used_bytes
    hashes = new_hashes(3)
    assert a.store(hashes) == [1] * 3
    wait_in_directory(fleet.coordinator.target, hashes, a.status().instance_id)
    before_b, before_a = b.status().p2p, a.status().p2p

    proxy.to_client.clear()  # A's answer to B's LockPrefix will wait in front of B
    replies: list[Any] = []
    try:
        asker = _ask(b, hashes, replies)
        wait_until(
            lambda: a.status().p2p.active_leases == 1,
            timeout=30,
            message="A never leased the prefix to B",
        )
        assert a.read_locked() == 3
        # The keys are deleted by force while the lease holds them: they leave A's
        # index at once; their memory waits for the lease to let go.
        assert a.delete(hashes, force=True) == 3
        held = a.status()
        assert held.l1.resident_objects == len(proxied.warm)
        assert held.p2p.active_leases == 1
    finally:
        proxy.to_client.set()
    asker.join(60)

    assert replies
    assert replies[0].completed
    assert replies[0].result.hit_chunks == 0  # the stream had nothing to send: a clean miss
    status = b.status()
    assert status.p2p.fetches == before_b.fetches + 1
    assert status.p2p.fetched_chunks == before_b.fetched_chunks
    assert status.l1.read_locked_objects == 0
    assert status.l1.staging_objects == 0
    assert status.l1.resident_objects == len(proxied.warm)
    # A: the lease ended with the stream, nothing was served, every lock and byte is back.
    wait_until(
        lambda: a.status().p2p.active_leases == 0 and a.read_locked() == 0,
        timeout=10,
        message="the lease of deleted keys was left on A",
    )
    after_a = a.status()
    assert after_a.p2p.leases_granted == before_a.leases_granted + 1
    assert after_a.p2p.served_chunks == before_a.served_chunks
    assert after_a.p2p.leases_expired == before_a.leases_expired  # ended by the stream
    wait_until(
        lambda: a.status().l1.used_bytes == used_before,
        timeout=10,
        message="the deleted chunks' memory was never freed on A",
    )
