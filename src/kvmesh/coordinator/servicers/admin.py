"""AdminService: checkpoints and status."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from kvmesh.api.coordinator.v1 import admin_pb2, admin_pb2_grpc
from kvmesh.common.errors import DeadlineExceeded, Unavailable
from kvmesh.coordinator import wire
from kvmesh.coordinator.core.coordinator import Coordinator
from kvmesh.coordinator.servicers.ingest import NodeStreams

VERSION = "0.1.0"


class SourceStatus(Protocol):
    """What GetStatus reports of the NATS event source (its stats snapshot has these).

    A protocol, so the services need not import the optional NATS source.
    """

    @property
    def connected(self) -> bool:
        """True while the source reads the stream."""
        ...

    @property
    def stream(self) -> str:
        """The JetStream stream read."""
        ...

    @property
    def next_seq(self) -> int:
        """The stream sequence of the next message to apply."""
        ...

    @property
    def pending(self) -> int:
        """Messages the stream held beyond the last one applied."""
        ...

    @property
    def applied(self) -> int:
        """Messages applied."""
        ...

    @property
    def skipped(self) -> int:
        """Messages that could not be decoded, validated or ingested."""
        ...


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    """Checkpoints and status."""

    def __init__(
        self,
        core: Coordinator,
        streams: NodeStreams,
        nats_stats: Callable[[], SourceStatus] | None = None,
    ) -> None:
        self.core = core
        self.streams = streams
        self.nats_stats = nats_stats

    async def Checkpoint(
        self, request: admin_pb2.CheckpointRequest, context: Any
    ) -> admin_pb2.CheckpointResponse:
        result = await asyncio.to_thread(self.core.checkpoint_now)
        if not result.ok:
            if "in flight" in result.error or "quiesce" in result.error.lower():
                raise DeadlineExceeded(f"checkpoint failed: {result.error}")
            raise Unavailable(f"checkpoint failed (the previous one is kept): {result.error}")
        return admin_pb2.CheckpointResponse(
            path=result.path,
            size_bytes=result.size_bytes,
            sections=list(result.sections),
            duration_seconds=result.duration_seconds,
        )

    async def GetStatus(
        self, request: admin_pb2.GetStatusRequest, context: Any
    ) -> admin_pb2.GetStatusResponse:
        s = self.core.status()
        response = admin_pb2.GetStatusResponse(
            version=VERSION,
            ready=s.eviction_ready,
            registered_instances=s.instances,
            connected_streams=self.streams.count(),
            batches_admitted=s.batches_admitted,
            batches_duplicate=s.batches_duplicate,
            batches_stale=s.batches_stale,
            num_keys=s.directory.num_keys,
            checkpoint_path=s.checkpoint_path,
            restored=s.restored,
            chunk_size=s.chunk_size,
        )
        ledger = self.core.commands
        response.command_results.extend(
            admin_pb2.CommandResultCount(command=command, result=result, count=count)
            for (command, result), count in sorted(ledger.result_counts().items())
        )
        response.recent_command_failures.extend(
            wire.command_failure(o) for o in ledger.recent_failures()
        )
        response.commands_awaiting_answer = ledger.awaiting()
        response.resyncs_requested = self.core.resync.stats().requested
        if s.started_at:
            response.started_at.CopyFrom(wire.timestamp(s.started_at))
        if s.last_checkpoint_time:
            response.last_checkpoint.CopyFrom(wire.timestamp(s.last_checkpoint_time))
        if self.nats_stats is not None:
            n = self.nats_stats()
            response.nats.CopyFrom(
                admin_pb2.NatsSourceStatus(
                    connected=n.connected,
                    stream=n.stream,
                    next_seq=n.next_seq,
                    pending=n.pending,
                    applied=n.applied,
                    skipped=n.skipped,
                )
            )
        return response
