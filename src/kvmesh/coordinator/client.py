"""Typed clients of the coordinator's services that nodes and tools use: ingest,
directory, membership (the operator's policy and admin clients are in
:mod:`kvmesh.coordinator.operator_client`).

Generated once from the .proto files and maintained by hand; a test checks that
every RPC of the service has a method here and that each default deadline
matches the "Deadline:" line of the RPC's comment.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import grpc

from kvmesh.api.coordinator.v1 import (
    directory_pb2,
    ingest_pb2,
    ingest_pb2_grpc,
    membership_pb2,
)
from kvmesh.rpc.client import CallPolicy, SyncClient
from kvmesh.rpc.errors import RpcError


class EventIngestClient(SyncClient):
    """Typed client of ``kvmesh.coordinator.v1.EventIngestService``."""

    SERVICE = "kvmesh.coordinator.v1.EventIngestService"
    POLICIES: Mapping[str, CallPolicy] = {
        "StreamEvents": CallPolicy(timeout=2.0, idempotent=False),
        "IngestBatches": CallPolicy(timeout=10.0, idempotent=True),
    }

    def _bind(self) -> None:
        # A bidirectional stream goes over the gRPC channel itself, not the unary transport.
        self._stream_stub = (
            None if self.channel is None else ingest_pb2_grpc.EventIngestServiceStub(self.channel)
        )

    def stream_events(
        self,
        requests: Iterator[ingest_pb2.StreamEventsRequest],
        *,
        metadata: tuple[tuple[str, str | bytes], ...] | None = None,
        wait_for_ready: bool = False,
    ) -> grpc._CallIterator[ingest_pb2.StreamEventsResponse]:
        """``StreamEvents``: open a storage node's bidirectional event stream.

        The call has no deadline: it lives as long as the node (the .proto's
        "Deadline: none (long-lived)"). ``StreamEvents``'s policy timeout is
        instead how long a caller waits for the coordinator to be reachable
        before opening the stream (the storage node's ``GrpcEventTransport``
        does so with a health check), and the call is never retried here: the
        caller reconnects and resends unacked batches. ``requests`` is
        consumed on a gRPC thread until it ends; the returned object iterates
        the responses and is a ``grpc.Call`` whose ``cancel()`` ends the
        stream. It needs a gRPC target: a local lane answers UNIMPLEMENTED.
        """
        if self._stream_stub is None:
            raise RpcError(
                grpc.StatusCode.UNIMPLEMENTED,
                "StreamEvents is a streaming RPC; the local lane serves unary RPCs only",
            )
        return self._stream_stub.StreamEvents(
            requests, metadata=metadata, wait_for_ready=wait_for_ready
        )

    def ingest_batches(
        self,
        request: ingest_pb2.IngestBatchesRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> ingest_pb2.IngestBatchesResponse:
        """``IngestBatches``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "IngestBatches",
            request,
            ingest_pb2.IngestBatchesResponse,
            timeout,
            wait_for_ready,
        )


class DirectoryClient(SyncClient):
    """Typed client of ``kvmesh.coordinator.v1.DirectoryService``."""

    SERVICE = "kvmesh.coordinator.v1.DirectoryService"
    POLICIES: Mapping[str, CallPolicy] = {
        "Lookup": CallPolicy(timeout=2.0, idempotent=True),
        "ListKeys": CallPolicy(timeout=10.0, idempotent=True),
        "GetStats": CallPolicy(timeout=2.0, idempotent=True),
        "ListIngestCursors": CallPolicy(timeout=2.0, idempotent=True),
        "ScoreEngines": CallPolicy(timeout=1.0, idempotent=True),
        "BlendLookup": CallPolicy(timeout=2.0, idempotent=True),
    }

    def lookup(
        self,
        request: directory_pb2.LookupRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> directory_pb2.LookupResponse:
        """``Lookup``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "Lookup",
            request,
            directory_pb2.LookupResponse,
            timeout,
            wait_for_ready,
        )

    def list_keys(
        self,
        request: directory_pb2.ListKeysRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> directory_pb2.ListKeysResponse:
        """``ListKeys``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "ListKeys",
            request,
            directory_pb2.ListKeysResponse,
            timeout,
            wait_for_ready,
        )

    def get_stats(
        self,
        request: directory_pb2.GetStatsRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> directory_pb2.GetStatsResponse:
        """``GetStats``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "GetStats",
            request,
            directory_pb2.GetStatsResponse,
            timeout,
            wait_for_ready,
        )

    def list_ingest_cursors(
        self,
        request: directory_pb2.ListIngestCursorsRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> directory_pb2.ListIngestCursorsResponse:
        """``ListIngestCursors``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "ListIngestCursors",
            request,
            directory_pb2.ListIngestCursorsResponse,
            timeout,
            wait_for_ready,
        )

    def score_engines(
        self,
        request: directory_pb2.ScoreEnginesRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> directory_pb2.ScoreEnginesResponse:
        """``ScoreEngines``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "ScoreEngines", request, directory_pb2.ScoreEnginesResponse, timeout, wait_for_ready
        )

    def blend_lookup(
        self,
        request: directory_pb2.BlendLookupRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> directory_pb2.BlendLookupResponse:
        """``BlendLookup``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "BlendLookup", request, directory_pb2.BlendLookupResponse, timeout, wait_for_ready
        )


class MembershipClient(SyncClient):
    """Typed client of ``kvmesh.coordinator.v1.MembershipService``."""

    SERVICE = "kvmesh.coordinator.v1.MembershipService"
    POLICIES: Mapping[str, CallPolicy] = {
        "RegisterInstance": CallPolicy(timeout=5.0, idempotent=True),
        "Heartbeat": CallPolicy(timeout=5.0, idempotent=True),
        "DeregisterInstance": CallPolicy(timeout=5.0, idempotent=True),
        "ListInstances": CallPolicy(timeout=5.0, idempotent=True),
    }

    def register_instance(
        self,
        request: membership_pb2.RegisterInstanceRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> membership_pb2.RegisterInstanceResponse:
        """``RegisterInstance``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "RegisterInstance",
            request,
            membership_pb2.RegisterInstanceResponse,
            timeout,
            wait_for_ready,
        )

    def heartbeat(
        self,
        request: membership_pb2.HeartbeatRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> membership_pb2.HeartbeatResponse:
        """``Heartbeat``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "Heartbeat",
            request,
            membership_pb2.HeartbeatResponse,
            timeout,
            wait_for_ready,
        )

    def deregister_instance(
        self,
        request: membership_pb2.DeregisterInstanceRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> membership_pb2.DeregisterInstanceResponse:
        """``DeregisterInstance``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "DeregisterInstance",
            request,
            membership_pb2.DeregisterInstanceResponse,
            timeout,
            wait_for_ready,
        )

    def list_instances(
        self,
        request: membership_pb2.ListInstancesRequest,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> membership_pb2.ListInstancesResponse:
        """``ListInstances``: see its comment in the .proto for semantics and errors."""
        return self._call(
            "ListInstances",
            request,
            membership_pb2.ListInstancesResponse,
            timeout,
            wait_for_ready,
        )
