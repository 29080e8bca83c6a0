"""The storage node's event stream to the coordinator over gRPC.

:class:`GrpcEventTransport` is the emitter's
:class:`~kvmesh.storage.events.transport.EventTransport` over
``EventIngestService.StreamEvents``. Each :meth:`~GrpcEventTransport.connect`
waits (bounded) until the coordinator serves ingest (a ``grpc.health.v1``
check with ``wait_for_ready`` and a deadline), then opens one bidirectional
call whose first message is ``open``; batches go up as ``batch``, acks and
coordinator commands come down, command results go up as
``command_result``. The node always dials (docs/events.md, "Who dials whom"):
the coordinator never needs a node's address to send it commands. The
registrar's client of ``MembershipService`` is
:mod:`kvmesh.storage.events.grpc_membership` (pass the same ``channel`` to
both to share it).

Threads of one :class:`GrpcEventSession` (all daemons, all ending when the
session ends, whether by :meth:`GrpcEventSession.close` or a stream error):

* gRPC's own request thread consumes the session's outbox (a queue fed by
  ``send`` and by command results, so the two writers are serialised); a
  sentinel ends it. Once the coordinator has announced batch groups (the
  ``kvmesh-batch-groups`` initial metadata, see ingest.proto), batches that
  are already waiting in the outbox when the thread comes for the next
  message go up together as one ``batches`` group (never waiting to fill
  one), which saves the per-message cost on both ends when the emitter has
  several batches in flight;
* the reader thread reads the initial metadata, then iterates the
  responses: acks — of a group too, one per batch in order — go straight
  to ``listener.on_ack`` (in stream order), commands to the session's
  :class:`~kvmesh.storage.events.commands.CommandExecutor`; when the stream
  ends it calls ``listener.on_closed`` exactly once (unless the session was
  closed by its owner, as the contract asks);
* the executor's worker runs ``listener.on_command`` one command at a time
  in arrival order, so a slow delete never stalls acks, and writes each
  result up the stream. It runs only while commands are waiting: an idle
  session has the reader and gRPC's request thread, nothing else.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterable, Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.api.coordinator.v1 import ingest_pb2
from kvmesh.api.events.v1 import events_pb2
from kvmesh.common.errors import InvalidArgument
from kvmesh.common.events import CacheEventBatch
from kvmesh.coordinator.client import EventIngestClient
from kvmesh.rpc.server import DEFAULT_MAX_MESSAGE_BYTES
from kvmesh.storage.events.codec import BatchEncoder, ingest_result_from_proto, result_to_proto
from kvmesh.storage.events.commands import CommandExecutor
from kvmesh.storage.events.transport import CommandResult, SessionListener, TransportError

logger = logging.getLogger(__name__)

__all__ = ["GrpcEventSession", "GrpcEventTransport"]

INGEST_SERVICE = ingest_pb2.DESCRIPTOR.services_by_name["EventIngestService"].full_name
#: Initial-metadata key by which the coordinator announces batch groups (ingest.proto).
BATCH_GROUPS_METADATA = "kvmesh-batch-groups"
#: Batches per group at most, unless the coordinator announced fewer. A cap,
#: not a target: a group holds the batches already waiting, so with the
#: emitter's default window (``DEFAULT_MAX_IN_FLIGHT_BATCHES``, 2) groups are
#: of 2 at most, as ``kvmesh bench ingest`` sends by default.
DEFAULT_MAX_GROUP_BATCHES = 32
#: Wire bytes per group at most (a bigger batch still goes alone), far below
#: any message-size limit a coordinator would run with.
MAX_GROUP_BYTES = 4 * 1024 * 1024
#: How long GrpcEventTransport.close waits for each session's threads.
_JOIN_TIMEOUT_S = 5.0


def _status(exc: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    # Every RpcError grpc raises is also a grpc.Call; be defensive anyway.
    if isinstance(exc, grpc.Call):
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.UNKNOWN, str(exc)


# --------------------------------------------------------------------------------------
# Event stream
# --------------------------------------------------------------------------------------


class GrpcEventSession:
    """One open ``StreamEvents`` call (module docstring: threads and shutdown).

    Created by :meth:`GrpcEventTransport.connect`; the emitter's sender thread
    calls :meth:`send`, anyone may call :meth:`close`.
    """

    def __init__(
        self,
        transport: GrpcEventTransport,
        instance_id: str,
        incarnation: int,
        listener: SessionListener,
    ) -> None:
        self.instance_id = instance_id
        self.incarnation = incarnation
        self._transport = transport
        self._listener = listener
        self._lock = threading.Lock()
        self._closing = False  # close() was called
        self._ended = False  # the stream is over, for whatever reason
        # Batches (encoded), other requests (command results) and the None sentinel.
        self._outbox: queue.SimpleQueue[
            events_pb2.CacheEventBatch | ingest_pb2.StreamEventsRequest | None
        ] = queue.SimpleQueue()
        self._commands = CommandExecutor(
            listener, self._send_result, name=f"event-stream-commands-{instance_id}"
        )
        # Batches per message: 1 until the coordinator announces groups.
        self._group_limit = 1
        self._max_group_batches = transport.max_group_batches
        self._encoder = BatchEncoder("the gRPC event stream")
        self._call: grpc._CallIterator[ingest_pb2.StreamEventsResponse] | None = None
        self._reader = threading.Thread(
            target=self._read, name=f"event-stream-reader-{instance_id}", daemon=True
        )

    def _open(self, client: EventIngestClient) -> None:
        """Start the call and the threads; raises TransportError when the call cannot start."""
        hello = ingest_pb2.StreamEventsRequest(
            open=ingest_pb2.StreamOpen(instance_id=self.instance_id, incarnation=self.incarnation)
        )
        try:
            call = client.stream_events(self._requests(hello), wait_for_ready=False)
        except Exception as exc:  # e.g. the channel was closed under us
            raise TransportError(f"cannot open the event stream: {exc}") from exc
        with self._lock:
            self._call = call
            closing = self._closing
        if closing:  # the transport closed while we were opening
            call.cancel()
        self._reader.start()

    def _requests(
        self, hello: ingest_pb2.StreamEventsRequest
    ) -> Iterator[ingest_pb2.StreamEventsRequest]:
        # Consumed by gRPC's request thread; returning half-closes the stream.
        yield hello
        outbox = self._outbox
        held: events_pb2.CacheEventBatch | ingest_pb2.StreamEventsRequest | None = None
        holding = False
        while True:
            if holding:
                item, held, holding = held, None, False
            else:
                item = outbox.get()
            if item is None:
                return
            if isinstance(item, ingest_pb2.StreamEventsRequest):
                yield item
                continue
            limit = self._group_limit
            if limit <= 1 or outbox.empty():
                yield ingest_pb2.StreamEventsRequest(batch=item)
                continue
            # Several batches are waiting already: one message for as many as fit.
            group = [item]
            size = item.ByteSize()
            while len(group) < limit:
                try:
                    nxt = outbox.get_nowait()
                except queue.Empty:
                    break
                if not isinstance(nxt, events_pb2.CacheEventBatch):
                    held, holding = nxt, True  # a command result or the end: after the group
                    break
                size += nxt.ByteSize()
                if size > MAX_GROUP_BYTES:
                    held, holding = nxt, True
                    break
                group.append(nxt)
            if len(group) == 1:
                yield ingest_pb2.StreamEventsRequest(batch=item)
            else:
                yield ingest_pb2.StreamEventsRequest(batches=ingest_pb2.BatchGroup(batches=group))

    @property
    def closed(self) -> bool:
        """True once the stream ended or :meth:`close` was called."""
        with self._lock:
            return self._ended or self._closing

    # ------------------------------------------------------------------ writing

    def send(self, batch: CacheEventBatch) -> None:
        """Queue ``batch`` on the stream (never blocks); TransportError when the stream is over."""
        if not self._write(self._encoder.to_proto(batch)):
            raise TransportError("the event stream is closed")

    def _write(self, request: events_pb2.CacheEventBatch | ingest_pb2.StreamEventsRequest) -> bool:
        with self._lock:
            if self._ended or self._closing:
                return False
            self._outbox.put(request)
            return True

    # ------------------------------------------------------------------ reading

    def _read(self) -> None:
        call = self._call
        assert call is not None
        error: BaseException | None = None
        try:
            # Sent when the coordinator accepted the stream (an older one sends
            # it with its first response); empty when the call ended first.
            self._accept_groups(call.initial_metadata() or ())
            for response in call:
                kind = response.WhichOneof("kind")
                if kind == "ack":
                    self._deliver_ack(response.ack)
                elif kind == "acks":
                    for ack in response.acks.acks:
                        self._deliver_ack(ack)
                elif kind == "command":
                    self._commands.submit(response.command)
                else:
                    logger.warning("ignoring an event-stream response with no known kind")
        except grpc.RpcError as exc:
            code, details = _status(exc)
            error = TransportError(f"event stream ended: {code.name}: {details}")
            if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                # Not a restart or an outage: the coordinator rejected something.
                logger.error("event stream to the coordinator failed: %s: %s", code.name, details)
        except Exception as exc:
            logger.exception("event stream reader failed")
            error = exc
        finally:
            self._finish(error)

    def _accept_groups(self, metadata: Iterable[tuple[str, str | bytes]]) -> None:
        """Allow batch groups as big as the coordinator announced (and this transport allows)."""
        for key, value in metadata:
            if key != BATCH_GROUPS_METADATA:
                continue
            try:
                announced = int(value)
            except ValueError:
                logger.warning("ignoring a malformed %s: %r", BATCH_GROUPS_METADATA, value)
                return
            self._group_limit = max(1, min(announced, self._max_group_batches))
            return

    def _deliver_ack(self, ack: ingest_pb2.BatchAck) -> None:
        if ack.incarnation != self.incarnation:
            # An ack for another incarnation says nothing about our seqs.
            logger.debug(
                "ignoring ack for incarnation %d (ours is %d)", ack.incarnation, self.incarnation
            )
            return
        result = ingest_result_from_proto(ack.result)
        if result is None:
            logger.warning("ignoring ack for seq %d with unknown result %d", ack.seq, ack.result)
            return
        try:
            self._listener.on_ack(ack.seq, result)
        except Exception:
            logger.exception("on_ack failed for seq %d", ack.seq)

    def _finish(self, error: BaseException | None) -> None:
        with self._lock:
            self._ended = True
            closed_by_owner = self._closing
        # Unblock gRPC's request thread; queued commands could not be answered any more.
        self._outbox.put(None)
        self._commands.close()
        call = self._call
        if call is not None:
            call.cancel()  # no-op when the call already ended
        self._transport._forget(self)
        if closed_by_owner:
            return
        try:
            self._listener.on_closed(error)
        except Exception:
            logger.exception("on_closed failed")

    # ------------------------------------------------------------------ commands

    def _send_result(self, result: CommandResult) -> None:
        """Write a command's result up the stream (on the command executor's worker)."""
        request = ingest_pb2.StreamEventsRequest(command_result=result_to_proto(result))
        if not self._write(request):
            logger.warning(
                "event stream ended before the result of command %s (%s) could be sent",
                result.command_id,
                result.code,
            )

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """End the stream without notifying the listener; idempotent, any thread, never blocks.

        Queued writes not yet on the wire are dropped (the emitter resends
        unacked batches on its next stream). The threads end promptly; use
        :meth:`join` to wait for them.
        """
        with self._lock:
            if self._closing:
                return
            self._closing = True
            call = self._call
        self._outbox.put(None)
        self._commands.close()
        # Cancel rather than wait for the coordinator to end its side after
        # our half-close: the contract does not say that it will.
        if call is not None:
            call.cancel()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the reader and command threads to end; True when both did."""
        reader = self._reader
        if reader is not threading.current_thread() and reader.ident is not None:
            reader.join(timeout)
        commands_done = self._commands.join(timeout)
        return commands_done and not reader.is_alive()


class GrpcEventTransport:
    """The emitter's :class:`~kvmesh.storage.events.transport.EventTransport` over gRPC.

    ``target`` is the coordinator's ``host:port`` (or ``unix:path``); pass
    ``channel`` to share one channel with the membership client (then the
    caller closes it). ``connect`` waits at most ``connect_timeout_s``
    (default: the ``StreamEvents`` policy timeout, 2 s) for the coordinator to
    serve ingest and raises :class:`TransportError` otherwise, so an absent
    (or shutting-down) coordinator never hangs the emitter's sender thread;
    the emitter then retries with its own backoff. ``max_group_batches``
    caps the batches sent in one group (1: never group).
    """

    def __init__(
        self,
        target: str,
        *,
        channel: grpc.Channel | None = None,
        connect_timeout_s: float | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_group_batches: int = DEFAULT_MAX_GROUP_BATCHES,
    ) -> None:
        if max_group_batches < 1:
            raise InvalidArgument("max_group_batches must be >= 1", field="max_group_batches")
        self.max_group_batches = max_group_batches
        timeout = (
            EventIngestClient.POLICIES["StreamEvents"].timeout
            if connect_timeout_s is None
            else connect_timeout_s
        )
        if not 0.0 < timeout < float("inf"):
            raise InvalidArgument(
                "connect_timeout_s must be finite and > 0", field="connect_timeout_s"
            )
        self._connect_timeout_s = timeout
        self._client = EventIngestClient(
            target, channel=channel, max_message_bytes=max_message_bytes
        )
        self._health = health_pb2_grpc.HealthStub(self._client.channel)
        self._lock = threading.Lock()
        self._sessions: set[GrpcEventSession] = set()
        self._closed = False

    @property
    def target(self) -> str:
        """The coordinator address this transport dials."""
        return self._client.target

    def connect(
        self, instance_id: str, incarnation: int, listener: SessionListener
    ) -> GrpcEventSession:
        """Open a ``StreamEvents`` call for this emitter; TransportError when unreachable."""
        with self._lock:
            if self._closed:
                raise TransportError("the event transport is closed")
        self._wait_until_serving()
        session = GrpcEventSession(self, instance_id, incarnation, listener)
        with self._lock:
            if self._closed:
                raise TransportError("the event transport is closed")
            self._sessions.add(session)
        try:
            session._open(self._client)
        except TransportError:
            self._forget(session)
            raise
        logger.debug("event stream to %s opened for %s/%d", self.target, instance_id, incarnation)
        return session

    def _wait_until_serving(self) -> None:
        """Bounded wait for the coordinator to serve ingest; TransportError otherwise.

        A health check with ``wait_for_ready`` and the connect timeout as its
        deadline, rather than ``grpc.channel_ready_future``: that one's
        connectivity-polling thread outlives the future by up to 0.2 s and
        raises "Channel closed!" if the channel closes meanwhile (grpcio
        1.85). It also refuses a coordinator that is shutting down
        (NOT_SERVING), so the emitter backs off instead of opening a stream
        that is about to end.
        """
        request = health_pb2.HealthCheckRequest(service=INGEST_SERVICE)
        try:
            reply = self._health.Check(
                request, timeout=self._connect_timeout_s, wait_for_ready=True
            )
        except grpc.RpcError as exc:
            code, details = _status(exc)
            if code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.NOT_FOUND):
                return  # no health service, or ingest not listed in it: the stream will tell
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TransportError(
                    f"coordinator {self.target} not reachable within {self._connect_timeout_s:g}s"
                ) from None
            raise TransportError(
                f"coordinator {self.target} health check failed: {code.name}: {details}"
            ) from None
        except ValueError as exc:  # the channel was closed under us
            raise TransportError(f"cannot connect to coordinator {self.target}: {exc}") from exc
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            raise TransportError(f"coordinator {self.target} is not serving event ingest")

    def _forget(self, session: GrpcEventSession) -> None:
        with self._lock:
            self._sessions.discard(session)

    def close(self, timeout: float = _JOIN_TIMEOUT_S) -> None:
        """Close every open session, wait up to ``timeout`` s for their threads, close the channel.

        Idempotent. Close the emitter first: afterwards ``connect`` fails.
        """
        with self._lock:
            self._closed = True
            sessions = list(self._sessions)
        for session in sessions:
            session.close()
        for session in sessions:
            if not session.join(timeout):
                logger.warning("event stream threads did not stop within %.1fs", timeout)
        self._client.close()
