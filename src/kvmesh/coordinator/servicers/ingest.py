"""EventIngestService: the node event streams, and the registry of open ones.

``StreamEvents`` is the one service with state of its own: each storage
node keeps one stream open; batches come up (singly, or in groups once the
stream's initial metadata announced them) and are acked in order, and the
coordinator's commands to that node (deletes chosen by fleet eviction,
operator deletes, resync requests) go down the same stream. The
:class:`NodeStreams` registry is also the core's ``DeleteDispatcher``: a
delete is deliverable exactly when the holding node's stream is open, so the
coordinator never dials a node.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvmesh.api.coordinator.v1 import ingest_pb2, ingest_pb2_grpc
from kvmesh.api.events.v1 import events_pb2
from kvmesh.common.convert import validated_batch_from_proto
from kvmesh.common.errors import InvalidArgument, KvmeshError
from kvmesh.common.events import IngestResult, Tier
from kvmesh.common.keys import ObjectKey
from kvmesh.coordinator.core.commands import CommandLedger
from kvmesh.coordinator.core.coordinator import Coordinator
from kvmesh.coordinator.core.tracing import ingest_traced
from kvmesh.coordinator.wire import (
    INGEST_RESULT,
    command_kind,
    command_summary,
    delete_command,
    resync_commands,
)

logger = logging.getLogger(__name__)

#: Initial-metadata key by which StreamEvents announces that it takes batch groups.
BATCH_GROUPS_METADATA = "kvmesh-batch-groups"
#: The most batches one BatchGroup may carry (announced under BATCH_GROUPS_METADATA).
MAX_GROUP_BATCHES = 64
#: A group is ingested batch after batch on the event loop; after this much of
#: it the reader lets the loop serve other streams and lookups before going on.
_GROUP_SLICE_S = 0.002


class _StreamReplaced(KvmeshError):
    """A newer stream of the same instance took over; the contract cancels the old one."""

    code = "CANCELLED"
    default_reason = "STREAM_REPLACED"


class _StreamFailed(KvmeshError):
    """The reader hit an unexpected error: the stream ends with INTERNAL, never silently OK."""

    code = "INTERNAL"
    default_reason = "INTERNAL"


class _CallEnded(Exception):
    """A write found the call already ended: there is no one left to answer."""


class _Failure:
    """Marker the reader puts in the outbox when the stream must end with an error."""

    def __init__(self, error: KvmeshError) -> None:
        self.error = error


@dataclass
class _Stream:
    instance_id: str
    incarnation: int
    loop: asyncio.AbstractEventLoop
    outbox: asyncio.Queue[ingest_pb2.StreamEventsResponse | _Failure | None]
    opened_at: float = field(default_factory=time.time)
    closed: bool = False


class NodeStreams:
    """Open event streams by instance, and the core's command dispatcher over them.

    Every command sent (down a stream here, or over NATS through
    :meth:`record_sent`) and every answer (:meth:`record_result`, from either
    transport) is reported to ``ledger`` — the core's
    :class:`~kvmesh.coordinator.core.commands.CommandLedger` — which is what
    operators see of them.
    """

    def __init__(self, ledger: CommandLedger | None = None) -> None:
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count(1)
        self.ledger = ledger if ledger is not None else CommandLedger()
        self.command_results: dict[str, ingest_pb2.CommandResult] = {}
        self.commands_sent = 0

    def open(self, stream: _Stream) -> _Stream | None:
        """Register a stream; returns the one it replaces (to be closed)."""
        with self._lock:
            old = self._streams.get(stream.instance_id)
            self._streams[stream.instance_id] = stream
        return old

    def close(self, stream: _Stream) -> None:
        """Forget a stream if it is still the current one of its instance."""
        with self._lock:
            if self._streams.get(stream.instance_id) is stream:
                del self._streams[stream.instance_id]
        stream.closed = True

    def connected(self, instance_id: str) -> bool:
        with self._lock:
            return instance_id in self._streams

    def count(self) -> int:
        with self._lock:
            return len(self._streams)

    def send(self, instance_id: str, command: ingest_pb2.NodeCommand) -> str:
        """Queue a command on the node's stream (any thread); its id, or "" when not connected."""
        with self._lock:
            stream = self._streams.get(instance_id)
        if stream is None or stream.closed:
            return ""
        if not command.command_id:
            command.command_id = f"cmd-{next(self._ids)}"
        response = ingest_pb2.StreamEventsResponse(command=command)
        try:
            stream.loop.call_soon_threadsafe(stream.outbox.put_nowait, response)
        except RuntimeError:  # the loop is closed: the stream is gone
            return ""
        self.commands_sent += 1
        self.record_sent(instance_id, command)
        return command.command_id

    def record_sent(self, instance_id: str, command: ingest_pb2.NodeCommand) -> None:
        """Tell the ledger a command went to ``instance_id`` (any transport)."""
        self.ledger.sent(
            command.command_id, instance_id, command_kind(command), command_summary(command)
        )

    def dispatch_delete(
        self,
        instance_id: str,
        tier: Tier,
        backend: str,
        keys: Sequence[ObjectKey],
        force: bool = False,
    ) -> str:
        """The core's DeleteDispatcher: a DeleteKeysCommand down the node's stream; its id."""
        return self.send(instance_id, delete_command(tier, backend, keys, force))

    def dispatch_resync(self, instance_id: str) -> bool:
        """The core's ResyncDispatcher: a ResyncCommand per tier down the node's stream."""
        # Every command is sent (no short cut after a failed one).
        sent = [self.send(instance_id, command) for command in resync_commands()]
        return all(sent)

    def record_result(self, instance_id: str, result: ingest_pb2.CommandResult) -> None:
        """A node's answer to a command (from its stream, or from NATS)."""
        with self._lock:
            self.command_results[result.command_id] = result
            while len(self.command_results) > 4096:
                self.command_results.pop(next(iter(self.command_results)))
        outcome = self.ledger.answered(
            instance_id,
            result.command_id,
            result.code,
            result.message,
            result.affected,
            result.effects_through_seq,
        )
        if not outcome.ok:
            logger.warning(
                "node %s refused command %s (%s %s): %s %s",
                instance_id,
                result.command_id,
                outcome.kind,
                outcome.summary,
                outcome.code,
                result.message,
            )


class EventIngestServicer(ingest_pb2_grpc.EventIngestServiceServicer):
    """Batches in, acks (and commands) out."""

    def __init__(self, core: Coordinator, streams: NodeStreams) -> None:
        self.core = core
        self.streams = streams

    def _ingest(
        self, stream: _Stream, msg: events_pb2.CacheEventBatch, field: str
    ) -> ingest_pb2.BatchAck:
        """Check, convert and ingest one batch of ``stream``; its ack."""
        if msg.instance_id != stream.instance_id:
            raise InvalidArgument(
                f"{field}.instance_id {msg.instance_id!r} differs from the stream's "
                f"{stream.instance_id!r}",
                field=f"{field}.instance_id",
            )
        batch = validated_batch_from_proto(msg, field)
        result = ingest_traced(self.core, batch, "grpc")
        return ingest_pb2.BatchAck(
            incarnation=batch.incarnation, seq=batch.seq, result=INGEST_RESULT[result]
        )

    async def _ingest_group(
        self,
        stream: _Stream,
        msgs: Sequence[events_pb2.CacheEventBatch],
        write: Callable[[ingest_pb2.StreamEventsResponse], Awaitable[None]],
    ) -> None:
        """Ingest a BatchGroup batch by batch; one AckGroup for the batches it applied."""
        n = len(msgs)
        if n > MAX_GROUP_BATCHES:
            raise InvalidArgument(
                f"a batch group holds at most {MAX_GROUP_BATCHES} batches, got {n}",
                field="batches.batches",
            )
        acks: list[ingest_pb2.BatchAck] = []
        clock = time.perf_counter
        try:
            started = clock()
            for i, msg in enumerate(msgs):
                acks.append(self._ingest(stream, msg, f"batches.batches[{i}]"))
                if i + 1 < n and clock() - started > _GROUP_SLICE_S:
                    await asyncio.sleep(0)
                    started = clock()
        finally:
            # Also when batch i was bad: the ones before it are applied and acked.
            if acks:
                await write(ingest_pb2.StreamEventsResponse(acks=ingest_pb2.AckGroup(acks=acks)))

    # A coroutine that writes with context.write() (gRPC's reader/writer API);
    # the generated stub types only the generator form.
    async def StreamEvents(  # type: ignore[override]
        self, request_iterator: AsyncIterator[ingest_pb2.StreamEventsRequest], context: Any
    ) -> None:
        first = await anext(aiter(request_iterator), None)
        if first is None:
            return
        if first.WhichOneof("kind") != "open":
            raise InvalidArgument("the first message of a stream must be 'open'", field="open")
        instance_id = first.open.instance_id
        if not instance_id:
            raise InvalidArgument("open.instance_id must not be empty", field="open.instance_id")
        # Tell the node it may send batch groups (ingest.proto: StreamEvents).
        await context.send_initial_metadata(((BATCH_GROUPS_METADATA, str(MAX_GROUP_BATCHES)),))
        stream = _Stream(
            instance_id, first.open.incarnation, asyncio.get_running_loop(), asyncio.Queue()
        )
        replaced = self.streams.open(stream)
        if replaced is not None:
            logger.info("a new event stream of %s replaces the old one", instance_id)
            # Acks written before this went out; the old call ends CANCELLED.
            ended = _Failure(
                _StreamReplaced(f"a newer event stream of {instance_id} replaced this one")
            )
            replaced.loop.call_soon_threadsafe(replaced.outbox.put_nowait, ended)
        # The reading task writes each ack itself as soon as its batch is
        # ingested (a queue between them cost a task switch per message and
        # held acks back behind the next group); this task writes what other
        # threads queue in the outbox. gRPC takes one write at a time.
        lock = asyncio.Lock()

        async def write(response: ingest_pb2.StreamEventsResponse) -> None:
            async with lock:
                try:
                    await context.write(response)
                except grpc.aio.BaseError as exc:  # the call ended: node gone, server stopping
                    raise _CallEnded from exc

        # An emitter the coordinator has no cursor for (a cold start, or a node
        # it dropped) is asked for everything it holds again (core.resync).
        self.core.stream_opened(instance_id)
        reader = asyncio.create_task(self._read(stream, request_iterator, write))
        try:
            while True:
                item = await stream.outbox.get()
                if item is None:
                    break
                if isinstance(item, _Failure):
                    # Batches before the bad one stay applied; this one touched nothing.
                    raise item.error
                try:
                    await write(item)
                except _CallEnded:
                    break
        finally:
            reader.cancel()
            self.streams.close(stream)

    async def _read(
        self,
        stream: _Stream,
        request_iterator: AsyncIterator[ingest_pb2.StreamEventsRequest],
        write: Callable[[ingest_pb2.StreamEventsResponse], Awaitable[None]],
    ) -> None:
        """Ingest the stream's batches in order and write their acks."""
        put = stream.outbox.put_nowait
        response = ingest_pb2.StreamEventsResponse
        try:
            async for request in request_iterator:
                kind = request.WhichOneof("kind")
                if kind == "batch":
                    await write(response(ack=self._ingest(stream, request.batch, "batch")))
                elif kind == "batches":
                    await self._ingest_group(stream, request.batches.batches, write)
                elif kind == "command_result":
                    self.streams.record_result(stream.instance_id, request.command_result)
                elif kind == "open":
                    raise InvalidArgument("a stream is opened only once", field="open")
        except KvmeshError as exc:
            put(_Failure(exc))
        except _CallEnded:
            # Nobody is left to answer; the node resends what it did not see acked.
            logger.debug("event stream of %s ended while acking", stream.instance_id)
        except Exception:
            # Without this the task would die quietly and the call end with OK,
            # leaving the node to guess why its batch was never acked.
            logger.exception("event stream of %s failed", stream.instance_id)
            put(
                _Failure(_StreamFailed(f"event stream of {stream.instance_id} failed; see the log"))
            )
        finally:
            put(None)

    async def IngestBatches(
        self, request: ingest_pb2.IngestBatchesRequest, context: Any
    ) -> ingest_pb2.IngestBatchesResponse:
        # Every batch is validated before any is ingested: one bad batch rejects the request.
        check = validated_batch_from_proto
        batches = [check(msg, f"batches[{i}]") for i, msg in enumerate(request.batches)]
        results = [self.core.ingest_validated(b) for b in batches]
        return ingest_pb2.IngestBatchesResponse(
            results=[INGEST_RESULT[r] for r in results],
            admitted=sum(1 for r in results if r is IngestResult.ADMITTED),
            duplicates=sum(1 for r in results if r is IngestResult.DUPLICATE),
            stale=sum(1 for r in results if r is IngestResult.STALE_INCARNATION),
        )
