"""The P2P data plane (TCP) of a real node: a lease's bytes, and every bad request refused.

The test plays the asking peer over a real socket: it locks a prefix with
PeerService.LockPrefix (gRPC), then speaks the data plane's wire format
(``kvmesh.storage.peers.tcp_stream``) to the port the answer names.
"""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import numpy as np

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.storage.v1 import peer_pb2
from kvmesh.storage.peers import tcp_stream as wire
from tests.integration.p2p.conftest import Fleet, running_fleet
from tests.integration.p2p.support import MIB, PeerNode, WideEngine, wait_in_directory
from tests.integration.storage.support import CHUNK_BYTES, blocks_of, grid, new_hashes
from tests.support.waiting import wait_until


def lock(node: PeerNode, keys: common_pb2.KeyGrid, **fields: object) -> peer_pb2.LockPrefixResponse:
    return node.peer.LockPrefix(peer_pb2.LockPrefixRequest(keys=keys, **fields), timeout=10)  # type: ignore[arg-type]


def dial(node: PeerNode, port: int | None = None) -> socket.socket:
    port = port or node.status().p2p.data_port
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def read_all(sock: socket.socket) -> bytes:
    out = bytearray()
    while chunk := sock.recv(1 << 20):
        out += chunk
    return bytes(out)


def parse(raw: bytes) -> tuple[list[tuple[int, bytes]], tuple[str, str] | None]:
    """The chunk records and the end record ``(status name, message)`` (None: none came)."""
    chunks: list[tuple[int, bytes]] = []
    pos = 0
    while pos + wire.RECORD.size <= len(raw):
        magic, number, size = wire.RECORD.unpack_from(raw, pos)
        body = raw[pos + wire.RECORD.size : pos + wire.RECORD.size + size]
        pos += wire.RECORD.size + size
        if magic == wire.END_MAGIC:
            assert pos == len(raw), "bytes after the end record"
            return chunks, (wire.status_name(number), body.decode())
        assert magic == wire.CHUNK_MAGIC
        chunks.append((number, body))
    return chunks, None


def exchange(
    node: PeerNode, request: bytes
) -> tuple[list[tuple[int, bytes]], tuple[str, str] | None]:
    with dial(node) as sock:
        sock.sendall(request)
        return parse(read_all(sock))


def grpc_bytes(node: PeerNode, keys: common_pb2.KeyGrid) -> list[bytes]:
    granted = lock(node, keys)
    got = [bytearray() for _ in range(granted.locked_chunks)]
    for frame in node.peer.ReadChunks(
        peer_pb2.ReadChunksRequest(lease_id=granted.lease_id), timeout=10
    ):
        got[frame.chunk_index] += frame.data
    return [bytes(g) for g in got]


def test_a_lease_read_over_tcp_gives_the_bytes_once_and_ends_the_lease(fleet: Fleet) -> None:
    a = fleet.a
    hashes = new_hashes(4)
    a.store(hashes)
    status = a.status().p2p
    assert status.transport == "tcp-stream"
    assert status.data_port > 0

    granted = lock(a, grid(hashes))
    assert granted.data_port == status.data_port
    assert a.read_locked() == 4
    chunks, end = exchange(a, wire.encode_request(granted.lease_id))
    assert end == ("OK", "")
    assert [i for i, _ in chunks] == [0, 1, 2, 3]
    assert all(len(body) == CHUNK_BYTES for _, body in chunks)
    # The same bytes as gRPC's ReadChunks serves.
    assert [body for _, body in chunks] == grpc_bytes(a, grid(hashes))
    wait_until(lambda: a.read_locked() == 0 and a.status().p2p.active_leases == 0, timeout=10)
    after = a.status().p2p
    assert after.served_chunks == status.served_chunks + 8  # 4 over TCP, 4 over gRPC
    # A lease is read once.
    chunks, end = exchange(a, wire.encode_request(granted.lease_id))
    assert chunks == []
    assert end is not None
    assert end[0] == "NOT_FOUND"
    # A miss answers no lease and no port.
    empty = lock(a, grid(new_hashes(2)))
    assert (empty.lease_id, empty.locked_chunks, empty.data_port) == ("", 0, 0)


def test_bad_requests_are_refused_with_a_status_and_change_nothing(fleet: Fleet) -> None:
    a = fleet.a
    hashes = new_hashes(2)
    a.store(hashes)
    granted = lock(a, grid(hashes))
    lease = granted.lease_id.encode()
    bad = {
        "wrong magic": struct.pack("<4sHH", b"HTTP", 1, len(lease)) + lease,
        "wrong version": struct.pack("<4sHH", wire.REQUEST_MAGIC, 9, len(lease)) + lease,
        "empty lease id": struct.pack("<4sHH", wire.REQUEST_MAGIC, 1, 0),
        "lease id too long": struct.pack("<4sHH", wire.REQUEST_MAGIC, 1, 300) + b"x" * 300,
        "not ASCII": struct.pack("<4sHH", wire.REQUEST_MAGIC, 1, 4) + b"\xff\xfe\xfd\xfc",
        "cut short": struct.pack("<4sHH", wire.REQUEST_MAGIC, 1, 40) + b"lease",
    }
    for name, request in bad.items():
        with dial(a) as sock:
            sock.sendall(request)
            if name == "cut short":
                sock.shutdown(socket.SHUT_WR)
            chunks, end = parse(read_all(sock))
        assert chunks == [], name
        assert end is not None, name
        assert end[0] == "INVALID_ARGUMENT", (name, end)
        assert end[1], name  # says why
    chunks, end = exchange(a, wire.encode_request("lease-1-000000000000"))
    assert end is not None
    assert end[0] == "NOT_FOUND"
    assert chunks == []
    # Nothing changed: the real lease still holds its locks and reads whole.
    assert a.read_locked() == 2
    assert a.status().p2p.active_leases == 1
    chunks, end = exchange(a, wire.encode_request(granted.lease_id))
    assert end == ("OK", "")
    assert len(chunks) == 2
    wait_until(lambda: a.read_locked() == 0, timeout=10)


def test_a_reader_that_hangs_up_after_one_chunk_frees_the_lease(fleet: Fleet) -> None:
    a = fleet.a
    hashes = new_hashes(4)
    a.store(hashes)
    granted = lock(a, grid(hashes))
    with dial(a) as sock:
        sock.sendall(wire.encode_request(granted.lease_id))
        sock.recv(wire.RECORD.size)
    wait_until(
        lambda: a.read_locked() == 0 and a.status().p2p.active_leases == 0,
        timeout=10,
        message="the lease of a reader that hung up was left on A",
    )
    assert a.status().p2p.leases_expired == 0  # ended by the stream, not by the TTL


def test_a_reader_that_stops_reading_never_holds_a_lock_past_the_lease_ttl(
    tmp_path: Path, shm_root: Path
) -> None:
    """The sender blocks in sendall (64 MiB, far more than the socket buffers hold);
    the lease's TTL ends the stream and its locks, and the reader never gets an end record."""
    big_l1 = ("--l1-size-bytes", str(96 * MIB))
    with running_fleet(tmp_path, shm_root, wide=True, a_args=big_l1) as fleet:
        a = fleet.a
        chunks = 32
        hashes = new_hashes(chunks)
        assert a.store(hashes) == [1] * chunks
        granted = lock(a, grid(hashes), lease_ttl_ms=3000)
        assert granted.locked_chunks == chunks
        with dial(a) as sock:
            sock.sendall(wire.encode_request(granted.lease_id))
            wait_until(
                lambda: a.status().p2p.leases_expired == 1,
                timeout=20,
                message="the stalled stream's lease never expired",
            )
            wait_until(
                lambda: a.read_locked() == 0 and a.status().p2p.active_leases == 0,
                timeout=20,
                message="the stalled stream kept its locks past the TTL",
            )
            received, end = parse(read_all(sock))
        assert end is None  # the stream was cut, not ended
        whole = [i for i, body in received if len(body) == WideEngine.CHUNK_BYTES]
        assert whole == list(range(len(whole)))
        assert len(whole) < chunks
        assert len(received) - len(whole) <= 1  # at most the chunk cut in the middle
        assert a.status().p2p.served_chunks == len(whole)


def test_a_peer_without_a_data_port_serves_over_grpc(tmp_path: Path, shm_root: Path) -> None:
    with running_fleet(tmp_path, shm_root, a_args=("--p2p-data-port", "-1")) as fleet:
        a, b = fleet.a, fleet.b
        status = a.status().p2p
        assert (status.transport, status.data_port) == ("grpc-stream", 0)
        hashes = new_hashes(3)
        assert a.store(hashes) == [1] * 3
        wait_in_directory(fleet.coordinator.target, hashes, a.status().instance_id)
        reply = b.lookup(hashes)
        assert reply.completed
        assert reply.result.hit_chunks == 3, b.proc.log()
        b.engine.fill(blocks_of(range(3), 20), 0.0)
        assert b.retrieve(hashes, base=20) == 3
        assert np.array_equal(
            np.asarray(b.engine.kv[:, :, blocks_of(range(3), 20)]),
            np.asarray(a.engine.kv[:, :, blocks_of(range(3))]),
        )
        assert a.status().p2p.served_chunks == 3
        wait_until(lambda: a.read_locked() == 0 and b.read_locked() == 0, timeout=10)


def test_unlock_during_a_stream_keeps_the_locks_until_the_stream_lets_go(
    tmp_path: Path, shm_root: Path
) -> None:
    big_l1 = ("--l1-size-bytes", str(96 * MIB))
    with running_fleet(tmp_path, shm_root, wide=True, a_args=big_l1) as fleet:
        a = fleet.a
        chunks = 32
        hashes = new_hashes(chunks)
        assert a.store(hashes) == [1] * chunks
        granted = lock(a, grid(hashes))
        with dial(a) as sock:
            sock.sendall(wire.encode_request(granted.lease_id))
            sock.recv(wire.RECORD.size)  # the stream runs: its sender reads A's L1 memory
            unlocked = a.peer.Unlock(peer_pb2.UnlockRequest(lease_id=granted.lease_id), timeout=5)
            assert unlocked.existed
            # The memory is still being sent from: the locks stay.
            assert a.read_locked() == chunks
            assert a.status().p2p.active_leases == 0
        wait_until(
            lambda: a.read_locked() == 0,
            timeout=20,
            message="the locks of an unlocked stream were kept after it ended",
        )


def test_a_peer_too_busy_to_stream_is_read_over_grpc_instead(
    tmp_path: Path, shm_root: Path
) -> None:
    """A's one stream is taken by a reader that never reads; B's fetch is refused
    (RESOURCE_EXHAUSTED) on the data plane and reads the same lease over ReadChunks."""
    big_l1 = ("--l1-size-bytes", str(128 * MIB))
    a_args = (*big_l1, "--p2p-max-streams", "1")
    with running_fleet(tmp_path, shm_root, wide=True, a_args=a_args, b_args=big_l1) as fleet:
        a, b = fleet.a, fleet.b
        stalled = new_hashes(32)
        wanted = new_hashes(4)
        assert a.store(stalled) == [1] * 32
        assert a.store(wanted, base=40) == [1] * 4
        wait_in_directory(fleet.coordinator.target, wanted, a.status().instance_id)
        granted = lock(a, grid(stalled))
        with dial(a) as sock:
            sock.sendall(wire.encode_request(granted.lease_id))
            sock.recv(wire.RECORD.size)  # A's only sender is now blocked on this reader
            reply = b.lookup(wanted)
            assert reply.completed
            assert reply.result.hit_chunks == 4, b.proc.log()
        b.engine.fill(blocks_of(range(4), 20), 0.0)
        assert b.retrieve(wanted, base=20) == 4
        assert b.engine.blocks_bytes(blocks_of(range(4), 20)) == a.engine.blocks_bytes(
            blocks_of(range(4), 40)
        )
        wait_until(lambda: a.read_locked() == 0 and b.read_locked() == 0, timeout=20)
