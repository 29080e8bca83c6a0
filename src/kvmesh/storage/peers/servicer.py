"""``kvmesh.storage.v1.PeerService``: a thin adapter from protobuf to PeerLeases."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.storage.v1 import peer_pb2, peer_pb2_grpc
from kvmesh.common.errors import InvalidArgument
from kvmesh.common.keys import CHUNK_HASH_BYTES, ObjectKey
from kvmesh.storage.core.peer.leases import PeerLeases
from kvmesh.storage.peer_frames import encode_frame

#: Longest a LockPrefix waits for this node's L2 loads when the caller set no deadline.
MAX_LOCK_WAIT_S = 30.0


def grid_rows(grid: common_pb2.KeyGrid) -> list[list[ObjectKey]]:
    """The keys of a KeyGrid, one row per kv rank (hash lengths checked)."""
    for i, h in enumerate(grid.chunk_hashes):
        if len(h) != CHUNK_HASH_BYTES:
            raise InvalidArgument(
                f"keys.chunk_hashes[{i}] must be {CHUNK_HASH_BYTES} bytes, got {len(h)}",
                field="keys.chunk_hashes",
            )
    return [
        [
            ObjectKey(h, grid.model_name, rank, grid.object_group_id, grid.cache_salt)
            for h in grid.chunk_hashes
        ]
        for rank in grid.kv_ranks
    ]


class PeerServicer(peer_pb2_grpc.PeerServiceServicer):
    """Every RPC converts its request, calls the leases, converts the answer."""

    def __init__(self, leases: PeerLeases) -> None:
        self.leases = leases
        #: The TCP data plane's port, named in every LockPrefix answer (0: none).
        self.data_port = 0

    async def LockPrefix(
        self, request: peer_pb2.LockPrefixRequest, context: Any
    ) -> peer_pb2.LockPrefixResponse:
        rows = grid_rows(request.keys)
        remaining = context.time_remaining() if context is not None else None
        wait_s = MAX_LOCK_WAIT_S if remaining is None else min(MAX_LOCK_WAIT_S, remaining * 0.8)
        grant = await self.leases.lock(
            rows,
            ttl_ms=request.lease_ttl_ms,
            expected_incarnation=request.expected_incarnation,
            requester=request.requester_id[:200],
            wait_s=max(0.001, wait_s),
        )
        return peer_pb2.LockPrefixResponse(
            lease_id=grant.lease_id,
            locked_chunks=grant.locked_chunks,
            chunk_sizes=grant.chunk_sizes,
            instance_id=self.leases.instance_id,
            incarnation=self.leases.incarnation,
            lease_ttl_ms=int(grant.ttl_s * 1000),
            data_port=self.data_port if grant.lease_id else 0,
        )

    async def ReadChunks(  # type: ignore[override]  # yields encoded ChunkFrames
        self, request: peer_pb2.ReadChunksRequest, context: Any
    ) -> AsyncIterator[bytes]:
        """Yields ChunkFrames already encoded (see ``kvmesh.storage.peer_frames``).

        Registered with an identity serializer by :func:`add_peer_service`.
        """
        frames = self.leases.read(request.lease_id, request.max_frame_bytes)
        try:
            async for index, offset, data in frames:
                yield encode_frame(index, offset, data)
        finally:
            await frames.aclose()  # ends the lease even when the stream is cancelled

    async def Unlock(
        self, request: peer_pb2.UnlockRequest, context: Any
    ) -> peer_pb2.UnlockResponse:
        return peer_pb2.UnlockResponse(existed=self.leases.release(request.lease_id))


def add_peer_service(servicer: PeerServicer, server: grpc.aio.Server) -> None:
    """Register PeerService as the generated ``add_PeerServiceServicer_to_server`` does,
    except that ReadChunks's frames are sent as the servicer encoded them."""
    handlers: dict[str, Any] = {
        "LockPrefix": grpc.unary_unary_rpc_method_handler(
            servicer.LockPrefix,
            request_deserializer=peer_pb2.LockPrefixRequest.FromString,
            response_serializer=peer_pb2.LockPrefixResponse.SerializeToString,
        ),
        "ReadChunks": grpc.unary_stream_rpc_method_handler(
            servicer.ReadChunks,
            request_deserializer=peer_pb2.ReadChunksRequest.FromString,
            response_serializer=_encoded,
        ),
        "Unlock": grpc.unary_unary_rpc_method_handler(
            servicer.Unlock,
            request_deserializer=peer_pb2.UnlockRequest.FromString,
            response_serializer=peer_pb2.UnlockResponse.SerializeToString,
        ),
    }
    name = "kvmesh.storage.v1.PeerService"
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


def _encoded(frame: bytes) -> bytes:
    return frame
