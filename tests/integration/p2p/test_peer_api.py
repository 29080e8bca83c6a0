"""PeerService on a real node: leases end on unlock, stream cancel and TTL; bad input is refused.

The test plays the asking peer with the generated stub over a real socket.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.storage.v1 import peer_pb2
from kvmesh.rpc.interceptors import error_info
from kvmesh.storage.peer_frames import decode_frame, encode_frame
from tests.integration.p2p.conftest import Fleet
from tests.integration.p2p.support import PeerNode
from tests.integration.storage.support import CHUNK_BYTES, MODEL, grid, new_hashes
from tests.support.waiting import wait_until


def lock(node: PeerNode, keys: common_pb2.KeyGrid, **fields: Any) -> peer_pb2.LockPrefixResponse:
    return node.peer.LockPrefix(peer_pb2.LockPrefixRequest(keys=keys, **fields), timeout=10)


def leases(node: PeerNode) -> int:
    return int(node.status().p2p.active_leases)


def test_a_lease_locks_the_prefix_and_every_way_of_ending_it_releases_it(fleet: Fleet) -> None:
    a = fleet.a
    hashes = new_hashes(4)
    a.store(hashes)

    granted = lock(a, grid(hashes + new_hashes(1)))  # the 5th chunk is not on A
    assert granted.locked_chunks == 4
    assert list(granted.chunk_sizes) == [CHUNK_BYTES] * 4
    assert granted.incarnation == a.status().incarnation
    assert a.read_locked() == 4
    # Explicit unlock (idempotent).
    assert a.peer.Unlock(peer_pb2.UnlockRequest(lease_id=granted.lease_id), timeout=5).existed
    assert not a.peer.Unlock(peer_pb2.UnlockRequest(lease_id=granted.lease_id), timeout=5).existed
    assert a.read_locked() == 0

    # A full read: every byte, in bounded frames, and the lease ends with the stream.
    granted = lock(a, grid(hashes))
    frames = list(
        a.peer.ReadChunks(
            peer_pb2.ReadChunksRequest(lease_id=granted.lease_id, max_frame_bytes=1000),
            timeout=10,
        )
    )
    assert all(len(f.data) <= 1000 for f in frames)
    got = [bytearray() for _ in hashes]
    for f in frames:
        assert f.offset == len(got[f.chunk_index])
        got[f.chunk_index] += f.data
    assert [len(g) for g in got] == [CHUNK_BYTES] * 4
    assert a.read_locked() == 0
    assert leases(a) == 0
    with pytest.raises(grpc.RpcError) as info:  # a lease is read once
        list(a.peer.ReadChunks(peer_pb2.ReadChunksRequest(lease_id=granted.lease_id), timeout=5))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND

    # A stream the reader cancels after one frame.
    granted = lock(a, grid(hashes))
    call = a.peer.ReadChunks(
        peer_pb2.ReadChunksRequest(lease_id=granted.lease_id, max_frame_bytes=512), timeout=10
    )
    next(call)
    call.cancel()
    wait_until(lambda: a.read_locked() == 0 and leases(a) == 0, timeout=10)

    # A lease nobody reads ends with its TTL.
    granted = lock(a, grid(hashes), lease_ttl_ms=300)
    assert granted.lease_ttl_ms == 300
    assert a.read_locked() == 4
    wait_until(lambda: a.read_locked() == 0 and leases(a) == 0, timeout=10)
    assert a.status().p2p.leases_expired == 1


def test_the_wire_frames_are_ordinary_chunk_frames() -> None:
    raw = encode_frame(300, 70_000, memoryview(b"abc" * 1000))
    parsed = peer_pb2.ChunkFrame.FromString(raw)
    assert (parsed.chunk_index, parsed.offset, parsed.data) == (300, 70_000, b"abc" * 1000)
    index, offset, data = decode_frame(raw)
    assert (index, offset, bytes(data)) == (300, 70_000, b"abc" * 1000)
    zero = peer_pb2.ChunkFrame(chunk_index=0, offset=0, data=b"x").SerializeToString()
    index, offset, data = decode_frame(zero)  # protobuf omits zero fields: still decoded
    assert (index, offset, bytes(data)) == (0, 0, b"x")


BAD_LOCKS = [
    ({"keys": grid([b"short"])}, "keys.chunk_hashes"),
    ({"keys": grid(new_hashes(1), model="")}, "keys.model_name"),
    ({"keys": grid(new_hashes(1), kv_ranks=())}, "keys.kv_ranks"),
    ({"keys": grid(new_hashes(1), kv_ranks=(0, 0))}, "keys.kv_ranks"),
    ({"keys": grid([])}, "keys.chunk_hashes"),
    ({"keys": grid(new_hashes(1), salt="a/b")}, None),
    ({"keys": grid(new_hashes(65))}, "keys"),
    ({"keys": grid(new_hashes(1)), "lease_ttl_ms": 600_001}, "lease_ttl_ms"),
]


def test_malformed_peer_requests_are_invalid_argument_and_change_nothing(fleet: Fleet) -> None:
    a = fleet.a
    hashes = new_hashes(2)
    a.store(hashes)
    before = a.status()
    for fields, field in BAD_LOCKS:
        with pytest.raises(grpc.RpcError) as info:
            a.peer.LockPrefix(peer_pb2.LockPrefixRequest(**fields), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
        if field is not None:
            details = error_info(info.value)
            assert details is not None, fields
            assert details.metadata["field"] == field, fields
    # A restarted peer (another incarnation than the directory said) refuses.
    with pytest.raises(grpc.RpcError) as info:
        lock(a, grid(hashes), expected_incarnation=before.incarnation + 1)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(info.value).reason == "INCARNATION_MISMATCH"  # type: ignore[union-attr]
    # A frame size beyond the limit (on an unknown lease); an unknown lease.
    with pytest.raises(grpc.RpcError) as info:
        list(
            a.peer.ReadChunks(
                peer_pb2.ReadChunksRequest(lease_id="lease-nope", max_frame_bytes=1 << 25),
                timeout=5,
            )
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as info:
        list(a.peer.ReadChunks(peer_pb2.ReadChunksRequest(lease_id="lease-nope"), timeout=5))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    # Nothing changed: same objects, no lock, no lease.
    after = a.status()
    assert after.l1.resident_objects == before.l1.resident_objects == 2
    assert after.l1.read_locked_objects == 0
    assert after.p2p.active_leases == 0


def test_a_read_refused_for_its_frame_size_ends_the_lease_at_once(fleet: Fleet) -> None:
    a = fleet.a
    hashes = new_hashes(3)
    a.store(hashes)
    granted = lock(a, grid(hashes), lease_ttl_ms=600_000)  # a TTL far beyond the test
    assert granted.locked_chunks == 3
    assert granted.lease_ttl_ms == 240_000  # 0.8 of the 300 s read TTL: ends before a lapse
    assert a.read_locked() == 3
    with pytest.raises(grpc.RpcError) as info:
        list(
            a.peer.ReadChunks(
                peer_pb2.ReadChunksRequest(lease_id=granted.lease_id, max_frame_bytes=1 << 25),
                timeout=5,
            )
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = error_info(info.value)
    assert details is not None
    assert details.metadata["field"] == "max_frame_bytes"
    # The refused stream ended its lease: no lock waits for the TTL.
    status = a.status()
    assert status.l1.read_locked_objects == 0
    assert status.p2p.active_leases == 0
    assert status.p2p.leases_expired == 0
    assert not a.peer.Unlock(peer_pb2.UnlockRequest(lease_id=granted.lease_id), timeout=5).existed
    # The chunks stay, unlocked, and can be leased and read again.
    assert status.l1.resident_objects == 3
    again = lock(a, grid(hashes))
    frames = list(
        a.peer.ReadChunks(peer_pb2.ReadChunksRequest(lease_id=again.lease_id), timeout=10)
    )
    assert sum(len(f.data) for f in frames) == 3 * CHUNK_BYTES
    assert a.read_locked() == 0


def test_a_peer_serves_only_the_model_and_salt_asked(fleet: Fleet) -> None:
    a = fleet.a
    hashes = new_hashes(2)
    a.store(hashes, salt="t1")
    assert lock(a, grid(hashes, salt="t2")).locked_chunks == 0
    assert lock(a, grid(hashes)).locked_chunks == 0
    assert lock(a, grid(hashes, salt="t1", model=MODEL + "-other")).locked_chunks == 0
    granted = lock(a, grid(hashes, salt="t1"))
    assert granted.locked_chunks == 2
    a.peer.Unlock(peer_pb2.UnlockRequest(lease_id=granted.lease_id), timeout=5)
    assert a.read_locked() == 0
