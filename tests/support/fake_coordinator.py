"""A small coordinator for the storage link's tests: ingest stream + membership, over real gRPC.

It serves ``kvmesh.coordinator.v1.EventIngestService`` (``StreamEvents``,
``IngestBatches``) and ``MembershipService`` through the real chassis
(``create_server``: interceptors, health, reflection), with the EventGate's
admission rules (docs/coordinator.md, "Event gate") — a fresh cursor per new
emitter or incarnation, ``seq <= last_seq`` a duplicate, an older
incarnation stale, a skipped seq admitted with a sticky gap flag — and
membership with NOT_FOUND for unknown heartbeats.

The real coordinator servicer is being written in parallel. The tests use
only what :class:`CoordinatorView` declares to observe the coordinator (plus
the fault-injection methods, which only this fake has), so the happy-path
tests can run against the real one later through an adapter over its
DirectoryService/MembershipService.

All state lives in :class:`FakeCoordinator`, independent of the server, so a
test can stop the server and start a new one on the same port with the same
state (a coordinator restarting from its checkpoint).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from prometheus_client.registry import Collector

from kvmesh.api.coordinator.v1 import (
    ingest_pb2,
    ingest_pb2_grpc,
    membership_pb2,
    membership_pb2_grpc,
)
from kvmesh.api.events.v1 import events_pb2
from kvmesh.common.convert import batch_from_proto
from kvmesh.common.errors import InvalidArgument, NotFound
from kvmesh.common.events import CacheEventBatch, IngestResult, validate_batch
from kvmesh.rpc.interceptors import ServiceInterceptor
from kvmesh.rpc.server import ServiceBinding
from tests.support.harness import ServerThread

DEADLINE_S = 10.0
INGEST_SERVICE = "kvmesh.coordinator.v1.EventIngestService"
MEMBERSHIP_SERVICE = "kvmesh.coordinator.v1.MembershipService"


class CoordinatorView(Protocol):
    """What the tests read from a coordinator (a real one would answer via its read APIs)."""

    def admitted(self, instance_id: str) -> list[CacheEventBatch]:
        """Every batch admitted for ``instance_id``, in admission order."""
        ...

    def cursor(self, instance_id: str) -> Cursor | None:
        """The gate's cursor for ``instance_id``."""
        ...

    def wait_for(self, predicate: Callable[[], bool], timeout: float = DEADLINE_S) -> None:
        """Block until ``predicate()`` holds; AssertionError after ``timeout``."""
        ...


@dataclass
class Cursor:
    """Per-emitter stream position (docs/coordinator.md, "Event gate")."""

    incarnation: int
    last_seq: int = 0
    gap_detected: bool = False


@dataclass
class InstanceRecord:
    """One registered node."""

    request: membership_pb2.RegisterInstanceRequest
    heartbeats: int = 0


@dataclass
class _Fault:
    after_batches: int
    ingest_last: bool
    code: grpc.StatusCode
    message: str


@dataclass
class _Abort:
    code: grpc.StatusCode
    message: str


_END = object()


@dataclass(eq=False)
class _Stream:
    instance_id: str
    incarnation: int
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)

    def put(self, item: object) -> None:
        """Queue ``item`` for the client (from any thread)."""
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class FakeCoordinator:
    """The state behind the fake servicers, plus fault injection; thread-safe."""

    def __init__(self, *, heartbeat_interval_ms: int = 50, instance_timeout_ms: int = 1500) -> None:
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.instance_timeout_ms = instance_timeout_ms
        self._cond = threading.Condition()
        self._cursors: dict[str, Cursor] = {}
        self._admitted: dict[str, list[CacheEventBatch]] = {}
        self.verdicts: list[tuple[str, int, int, IngestResult]] = []
        self.fenced: list[str] = []
        self.streams_opened = 0
        self._live: dict[str, _Stream] = {}
        self.command_results: dict[str, ingest_pb2.CommandResult] = {}
        self.instances: dict[str, InstanceRecord] = {}
        self.registrations = 0
        self.deregistrations = 0
        self.heartbeats_not_found = 0
        self._fault: _Fault | None = None
        #: Keep a stream open after the node half-closes it (a coordinator
        #: that only ends streams on its own terms).
        self.hold_half_closed_streams = False

    # ------------------------------------------------------------------ gate

    def ingest(self, batch: CacheEventBatch) -> IngestResult:
        """The reference EventGate's admission, recording what it admitted."""
        with self._cond:
            result = self._admit(batch)
            self.verdicts.append((batch.instance_id, batch.incarnation, batch.seq, result))
            self._cond.notify_all()
            return result

    def _admit(self, batch: CacheEventBatch) -> IngestResult:
        cursor = self._cursors.get(batch.instance_id)
        if cursor is not None:
            if batch.incarnation < cursor.incarnation:
                return IngestResult.STALE_INCARNATION
            if batch.incarnation > cursor.incarnation:
                self.fenced.append(batch.instance_id)
                cursor = None
            elif batch.seq <= cursor.last_seq:
                return IngestResult.DUPLICATE
        if cursor is None:
            cursor = Cursor(incarnation=batch.incarnation)
            self._cursors[batch.instance_id] = cursor
        if batch.seq > cursor.last_seq + 1:
            cursor.gap_detected = True
        cursor.last_seq = batch.seq
        self._admitted.setdefault(batch.instance_id, []).append(batch)
        return IngestResult.ADMITTED

    # ------------------------------------------------------------------ CoordinatorView

    def admitted(self, instance_id: str) -> list[CacheEventBatch]:
        """Every batch admitted for ``instance_id``, in admission order."""
        with self._cond:
            return list(self._admitted.get(instance_id, ()))

    def cursor(self, instance_id: str) -> Cursor | None:
        """A copy of the gate's cursor for ``instance_id``."""
        with self._cond:
            c = self._cursors.get(instance_id)
            return None if c is None else Cursor(c.incarnation, c.last_seq, c.gap_detected)

    def wait_for(self, predicate: Callable[[], bool], timeout: float = DEADLINE_S) -> None:
        """Block until ``predicate()`` holds (re-checked on every state change)."""
        with self._cond:
            if not self._cond.wait_for(predicate, timeout):
                raise AssertionError(f"coordinator condition not met within {timeout} s")

    def duplicates(self, instance_id: str) -> int:
        """How many batches of ``instance_id`` were answered DUPLICATE."""
        with self._cond:
            return sum(
                1
                for i, _, _, r in self.verdicts
                if i == instance_id and r is IngestResult.DUPLICATE
            )

    # ------------------------------------------------------------------ fault injection

    def abort_stream_after(
        self,
        batches: int,
        *,
        ingest_last: bool = True,
        code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
        message: str = "injected stream failure",
    ) -> None:
        """Abort the stream that receives the ``batches``-th batch from now (once).

        ``ingest_last`` True: that batch is ingested but its ack is lost;
        False: it is lost in transit (never ingested).
        """
        with self._cond:
            self._fault = _Fault(batches, ingest_last, code, message)

    def push_command(self, instance_id: str, command: ingest_pb2.NodeCommand) -> None:
        """Send ``command`` down the live stream of ``instance_id``."""
        self.push_response(instance_id, ingest_pb2.StreamEventsResponse(command=command))

    def push_response(self, instance_id: str, response: ingest_pb2.StreamEventsResponse) -> None:
        """Send any response down the live stream of ``instance_id``."""
        with self._cond:
            stream = self._live.get(instance_id)
        if stream is None:
            raise AssertionError(f"no live event stream for {instance_id}")
        stream.put(response)

    def break_stream(self, instance_id: str, code: grpc.StatusCode, message: str) -> None:
        """Abort the live stream of ``instance_id`` now."""
        with self._cond:
            stream = self._live.get(instance_id)
        if stream is None:
            raise AssertionError(f"no live event stream for {instance_id}")
        stream.put(_Abort(code, message))

    def connected(self, instance_id: str) -> bool:
        """True while a stream of ``instance_id`` is open."""
        with self._cond:
            return instance_id in self._live

    def command_result(self, command_id: str) -> ingest_pb2.CommandResult:
        """Wait for the result of ``command_id`` and return it."""
        self.wait_for(lambda: command_id in self.command_results)
        with self._cond:
            return self.command_results[command_id]

    def forget(self, instance_id: str) -> None:
        """Drop a registered node, as a heartbeat timeout would."""
        with self._cond:
            self.instances.pop(instance_id, None)
            self._cond.notify_all()

    # ------------------------------------------------------------------ servicer hooks

    def _attach(self, open_msg: ingest_pb2.StreamOpen) -> _Stream:
        stream = _Stream(open_msg.instance_id, open_msg.incarnation, asyncio.get_running_loop())
        with self._cond:
            old = self._live.get(stream.instance_id)
            self._live[stream.instance_id] = stream
            self.streams_opened += 1
            self._cond.notify_all()
        if old is not None:  # the contract: a second stream replaces the first
            old.put(_Abort(grpc.StatusCode.CANCELLED, "replaced by a newer stream"))
        return stream

    def _detach(self, stream: _Stream) -> None:
        with self._cond:
            if self._live.get(stream.instance_id) is stream:
                del self._live[stream.instance_id]
            self._cond.notify_all()

    def _on_batch(self, batch: CacheEventBatch) -> tuple[IngestResult | None, _Abort | None]:
        """Ingest one streamed batch, applying an armed fault."""
        with self._cond:
            fault = self._fault
            if fault is not None:
                fault.after_batches -= 1
                if fault.after_batches <= 0:
                    self._fault = None
                else:
                    fault = None
        abort = None if fault is None else _Abort(fault.code, fault.message)
        if fault is not None and not fault.ingest_last:
            return None, abort
        return self.ingest(batch), abort

    def _record_result(self, result: ingest_pb2.CommandResult) -> None:
        with self._cond:
            self.command_results[result.command_id] = result
            self._cond.notify_all()


class _IngestServicer(ingest_pb2_grpc.EventIngestServiceServicer):
    def __init__(self, state: FakeCoordinator) -> None:
        self._state = state

    async def StreamEvents(  # noqa: N802 - the RPC's name
        self,
        request_iterator: AsyncIterator[ingest_pb2.StreamEventsRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[ingest_pb2.StreamEventsResponse]:
        try:
            first = await anext(request_iterator)
        except StopAsyncIteration:
            return
        if first.WhichOneof("kind") != "open":
            raise InvalidArgument("the first message must be open", field="open")
        stream = self._state._attach(first.open)
        reader = asyncio.create_task(self._consume(request_iterator, stream))
        try:
            while True:
                item = await stream.out.get()
                if item is _END:
                    return
                if isinstance(item, _Abort):
                    await context.abort(item.code, item.message)
                yield item
        finally:
            reader.cancel()
            self._state._detach(stream)

    async def _consume(
        self, requests: AsyncIterator[ingest_pb2.StreamEventsRequest], stream: _Stream
    ) -> None:
        state = self._state
        try:
            async for request in requests:
                kind = request.WhichOneof("kind")
                if kind == "batch":
                    try:
                        batch = batch_from_proto(request.batch)
                        validate_batch(batch)
                    except InvalidArgument as exc:
                        stream.put(_Abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message))
                        return
                    result, abort = state._on_batch(batch)
                    if result is not None:
                        ack = ingest_pb2.BatchAck(
                            incarnation=batch.incarnation,
                            seq=batch.seq,
                            result=events_pb2.IngestResult.ValueType(result),
                        )
                        if abort is None:
                            stream.put(ingest_pb2.StreamEventsResponse(ack=ack))
                    if abort is not None:
                        stream.put(abort)
                        return
                elif kind == "command_result":
                    state._record_result(request.command_result)
                else:
                    stream.put(_Abort(grpc.StatusCode.INVALID_ARGUMENT, "open sent twice"))
                    return
            # The node half-closed: end our side too, unless told to keep it open.
            if not state.hold_half_closed_streams:
                stream.put(_END)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the call died under us
            stream.put(_Abort(grpc.StatusCode.UNAVAILABLE, f"reader failed: {exc}"))

    async def IngestBatches(  # noqa: N802
        self, request: ingest_pb2.IngestBatchesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> ingest_pb2.IngestBatchesResponse:
        batches = [batch_from_proto(b, f"batches[{i}]") for i, b in enumerate(request.batches)]
        for i, batch in enumerate(batches):
            validate_batch(batch, f"batches[{i}]")
        results = [self._state.ingest(b) for b in batches]
        return ingest_pb2.IngestBatchesResponse(
            results=[events_pb2.IngestResult.ValueType(r) for r in results],
            admitted=results.count(IngestResult.ADMITTED),
            duplicates=results.count(IngestResult.DUPLICATE),
            stale=results.count(IngestResult.STALE_INCARNATION),
        )


class _MembershipServicer(membership_pb2_grpc.MembershipServiceServicer):
    def __init__(self, state: FakeCoordinator) -> None:
        self._state = state

    async def RegisterInstance(  # noqa: N802
        self,
        request: membership_pb2.RegisterInstanceRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> membership_pb2.RegisterInstanceResponse:
        if not request.instance_id:
            raise InvalidArgument("instance_id must not be empty", field="instance_id")
        state = self._state
        with state._cond:
            existed = request.instance_id in state.instances
            state.instances[request.instance_id] = InstanceRecord(request)
            state.registrations += 1
            state._cond.notify_all()
        return membership_pb2.RegisterInstanceResponse(
            instance_id=request.instance_id,
            re_registered=existed,
            heartbeat_interval_ms=state.heartbeat_interval_ms,
            instance_timeout_ms=state.instance_timeout_ms,
        )

    async def Heartbeat(  # noqa: N802
        self, request: membership_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> membership_pb2.HeartbeatResponse:
        state = self._state
        with state._cond:
            record = state.instances.get(request.instance_id)
            if record is None:
                state.heartbeats_not_found += 1
            else:
                record.heartbeats += 1
            state._cond.notify_all()
        if record is None:
            raise NotFound(f"instance {request.instance_id!r} is not registered")
        return membership_pb2.HeartbeatResponse()

    async def DeregisterInstance(  # noqa: N802
        self,
        request: membership_pb2.DeregisterInstanceRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> membership_pb2.DeregisterInstanceResponse:
        state = self._state
        with state._cond:
            existed = state.instances.pop(request.instance_id, None) is not None
            # Deregistration forgets the cursor too (docs/coordinator.md, "Event gate").
            state._cursors.pop(request.instance_id, None)
            state.deregistrations += 1
            state._cond.notify_all()
        return membership_pb2.DeregisterInstanceResponse(existed=existed)

    async def ListInstances(  # noqa: N802
        self,
        request: membership_pb2.ListInstancesRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> membership_pb2.ListInstancesResponse:
        with self._state._cond:
            records = list(self._state.instances.values())
        return membership_pb2.ListInstancesResponse(
            instances=[
                membership_pb2.Instance(
                    instance_id=r.request.instance_id,
                    incarnation=r.request.incarnation,
                    endpoints=r.request.endpoints,
                    metadata=r.request.metadata,
                )
                for r in records
            ]
        )


class FakeCoordinatorApp:
    """A :class:`~kvmesh.rpc.server.ServiceApp` serving the fake's two services."""

    name = "fake-coordinator"

    def __init__(self, state: FakeCoordinator) -> None:
        self.state = state

    def bindings(self) -> Sequence[ServiceBinding]:
        """Ingest and membership servicers over ``state``."""
        ingest = _IngestServicer(self.state)
        membership = _MembershipServicer(self.state)
        return [
            ServiceBinding(
                INGEST_SERVICE,
                lambda server: ingest_pb2_grpc.add_EventIngestServiceServicer_to_server(
                    ingest, server
                ),
            ),
            ServiceBinding(
                MEMBERSHIP_SERVICE,
                lambda server: membership_pb2_grpc.add_MembershipServiceServicer_to_server(
                    membership, server
                ),
            ),
        ]

    def collectors(self) -> Sequence[Collector]:
        """None."""
        return []

    async def start(self) -> None:
        """Nothing to start."""

    async def stop(self) -> None:
        """Nothing to stop."""


class CoordinatorHandle:
    """A fake coordinator on a fixed loopback port: start, stop, restart with the same state.

    The server is built like ``create_server`` builds one (the chassis'
    error-mapping interceptor, ``grpc.health.v1`` with each service SERVING)
    but binds without ``create_server``'s pre-bind probe: that probe binds
    without SO_REUSEADDR, so it refuses a port that still has TIME_WAIT
    connections — every restart on the same port within a minute of serving
    clients.
    """

    def __init__(self, thread: ServerThread, port: int, state: FakeCoordinator) -> None:
        self._thread = thread
        self.port = port
        self.state = state
        self._server: grpc.aio.Server | None = None
        self._health: HealthServicer | None = None

    @property
    def target(self) -> str:
        """What a client dials."""
        return f"127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        """True while serving."""
        return self._server is not None

    def start(self) -> None:
        """Serve on ``port`` (the same one on every restart)."""
        app = FakeCoordinatorApp(self.state)

        async def _start() -> tuple[grpc.aio.Server, HealthServicer]:
            server = grpc.aio.server(interceptors=[ServiceInterceptor(None)])
            bindings = app.bindings()
            for binding in bindings:
                binding.add_to_server(server)
            health = HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(health, server)
            if server.add_insecure_port(self.target) != self.port:
                raise RuntimeError(f"cannot listen on {self.target}")
            await server.start()
            for name in ["", *(b.name for b in bindings)]:
                await health.set(name, health_pb2.HealthCheckResponse.SERVING)
            return server, health

        self._server, self._health = self._thread.run(_start())

    def stop(self, grace: float = 0.0) -> None:
        """NOT_SERVING, then stop (open streams end with UNAVAILABLE/CANCELLED)."""
        server, health = self._server, self._health
        self._server = self._health = None
        if server is None or health is None:
            return

        async def _stop() -> None:
            await health.enter_graceful_shutdown()
            await server.stop(grace)

        self._thread.run(_stop())


__all__ = [
    "CoordinatorHandle",
    "CoordinatorView",
    "Cursor",
    "FakeCoordinator",
    "FakeCoordinatorApp",
]
