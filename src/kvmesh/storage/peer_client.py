"""Typed blocking client of another storage node's ``kvmesh.storage.v1.PeerService``.

What a storage node uses to reach a peer (P2P fetch); maintained by hand like
the other clients, with one method per RPC and the .proto's deadlines.
``ReadChunks`` is server-streaming, so it goes over the gRPC channel itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import grpc

from kvmesh.api.storage.v1 import peer_pb2
from kvmesh.rpc.client import CallPolicy, SyncClient
from kvmesh.rpc.errors import RpcError
from kvmesh.storage.peer_frames import decode_frame


class PeerClient(SyncClient):
    """Typed client of ``kvmesh.storage.v1.PeerService``."""

    SERVICE = "kvmesh.storage.v1.PeerService"
    POLICIES: Mapping[str, CallPolicy] = {
        "LockPrefix": CallPolicy(timeout=30.0, idempotent=False),
        "ReadChunks": CallPolicy(timeout=30.0, idempotent=False),
        "Unlock": CallPolicy(timeout=2.0, idempotent=True),
    }

    def _bind(self) -> None:
        # ReadChunks's frames are decoded without copying their payload (peer_frames).
        self._read_chunks = (
            None
            if self.channel is None
            else self.channel.unary_stream(
                f"/{self.SERVICE}/ReadChunks",
                request_serializer=peer_pb2.ReadChunksRequest.SerializeToString,
                response_deserializer=decode_frame,
            )
        )

    def lock_prefix(
        self,
        request: peer_pb2.LockPrefixRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> peer_pb2.LockPrefixResponse:
        """``LockPrefix``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "LockPrefix", request, peer_pb2.LockPrefixResponse, timeout, wait_for_ready
        )

    def read_chunks(
        self, request: peer_pb2.ReadChunksRequest, *, timeout: float | None = None
    ) -> Iterator[tuple[int, int, memoryview]]:
        """``ReadChunks``: ``(chunk_index, offset, data)`` per frame, data a view of the frame.

        The returned object is also a ``grpc.Call`` (``cancel()`` ends the stream).
        """
        if self._read_chunks is None:
            raise RpcError(
                grpc.StatusCode.UNIMPLEMENTED,
                "ReadChunks is a streaming RPC; the local lane serves unary RPCs only",
            )
        call: Iterator[tuple[int, int, memoryview]] = self._read_chunks(
            request, timeout=self.POLICIES["ReadChunks"].timeout if timeout is None else timeout
        )
        return call

    def unlock(
        self,
        request: peer_pb2.UnlockRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> peer_pb2.UnlockResponse:
        """``Unlock``: see its comment in the .proto for semantics and errors."""
        return self._call("Unlock", request, peer_pb2.UnlockResponse, timeout, wait_for_ready)
