"""The storage node's durable event link: cache events through NATS JetStream.

:class:`NatsEventTransport` is the emitter's
:class:`~kvmesh.storage.events.transport.EventTransport` over a JetStream
stream instead of a gRPC call to the coordinator (docs/events.md, "Transports").
The coordinator reads the stream at its own pace and keeps its read position
in its checkpoint (:mod:`kvmesh.coordinator.nats_source`), so events
published while it is down or after its last checkpoint are replayed, not
lost.

Wire layout (the stream, its headers, the command subjects beside it):
:mod:`kvmesh.storage.events.jetstream`.

Acks: a batch is acked to the emitter once JetStream answered its publish
with a PubAck (it is durably stored): ``ADMITTED``, or ``DUPLICATE`` when the
duplicate window recognised it. Publishes are pipelined and PubAcks are
delivered in seq order only, so the emitter's cumulative ack ("seq N and
everything before it") stays true. A publish error, a PubAck missing for
``ack_timeout_s`` or the connection dropping ends the session with a
:class:`~kvmesh.storage.events.transport.TransportError`; the emitter
reconnects with backoff and resends every unacked batch (the duplicate
window and, beyond it, the coordinator's seq dedup absorb repeats).

Threads and loops: nats-py is asyncio, the emitter is threads. The transport
runs one private event loop on a daemon thread (started by the first
:meth:`NatsEventTransport.connect`). One session is one NATS connection with
reconnection disabled, so a connection that breaks ends exactly one session
and nothing buffered in a half-dead client can be published out of order
later. ``send`` only encodes on the caller's thread and queues on the loop; a
writer coroutine publishes in seq order. Acks are delivered on the loop
thread; commands go to the session's
:class:`~kvmesh.storage.events.commands.CommandExecutor` (a slow delete
never delays acks), whose worker runs only while commands are waiting: an
idle session adds no thread of its own.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.nats_names import DEFAULT_NATS_URL, DEFAULT_STREAM
from kvmesh.storage.events.jetstream import StreamSettings
from kvmesh.storage.events.loop_thread import LoopThread
from kvmesh.storage.events.nats_session import NatsEventSession, close_client
from kvmesh.storage.events.transport import SessionListener, TransportError

logger = logging.getLogger(__name__)

__all__ = ["NatsEventSession", "NatsEventTransport"]

_JOIN_TIMEOUT_S = 5.0


class NatsEventTransport:
    """The emitter's :class:`~kvmesh.storage.events.transport.EventTransport` over NATS JetStream.

    ``url`` is the NATS server (``nats://host:4222``; a comma-separated list
    for a cluster); ``stream`` the stream's name or full
    :class:`StreamSettings`. ``connect`` gives up after ``connect_timeout_s``
    with :class:`TransportError` (the emitter retries with its backoff);
    a publish not acknowledged within ``ack_timeout_s`` ends the session.
    With ``create_stream`` False a missing stream is a connect failure.
    Call :meth:`close` after closing the emitter.
    """

    def __init__(
        self,
        url: str = DEFAULT_NATS_URL,
        *,
        stream: StreamSettings | str = DEFAULT_STREAM,
        connect_timeout_s: float = 2.0,
        ack_timeout_s: float = 5.0,
        create_stream: bool = True,
    ) -> None:
        if not url:
            raise InvalidArgument("the NATS url must not be empty", field="nats_url")
        for name, value in (
            ("connect_timeout_s", connect_timeout_s),
            ("ack_timeout_s", ack_timeout_s),
        ):
            if not 0.0 < value < float("inf"):
                raise InvalidArgument(f"{name} must be finite and > 0", field=name)
        self.url = url
        self.stream = stream if isinstance(stream, StreamSettings) else StreamSettings(name=stream)
        self.connect_timeout_s = connect_timeout_s
        self.ack_timeout_s = ack_timeout_s
        self.create_stream = create_stream
        self._lock = threading.Lock()
        self._loop_thread: LoopThread | None = None
        self._sessions: set[NatsEventSession] = set()
        self._closed = False

    def _loop(self) -> LoopThread:
        with self._lock:
            if self._closed:
                raise TransportError("the NATS event transport is closed")
            if self._loop_thread is None:
                self._loop_thread = LoopThread("nats-event-transport")
            return self._loop_thread

    def connect(
        self, instance_id: str, incarnation: int, listener: SessionListener
    ) -> NatsEventSession:
        """Open a session (a NATS connection) for this emitter; TransportError when unreachable."""
        thread = self._loop()
        session = NatsEventSession(self, thread.loop, instance_id, incarnation, listener)
        with self._lock:
            if self._closed:
                raise TransportError("the NATS event transport is closed")
            self._sessions.add(session)
        try:
            future = thread.submit(session._open())
        except RuntimeError as exc:
            self.forget(session)
            raise TransportError("the NATS event transport is closed") from exc
        try:
            # _open bounds itself; the margin covers a loop busy with other sessions.
            future.result(self.connect_timeout_s * 2 + 1.0)
        except TransportError:
            self.forget(session)
            raise
        except BaseException as exc:
            future.cancel()
            session.close()
            self.forget(session)
            if isinstance(exc, concurrent.futures.TimeoutError):
                raise TransportError(
                    f"NATS at {self.url} not usable within {self.connect_timeout_s:g}s"
                ) from None
            if isinstance(exc, Exception):
                raise TransportError(f"cannot open a NATS event session: {exc}") from exc
            raise
        logger.debug(
            "NATS event session to %s opened for %s/%d", self.url, instance_id, incarnation
        )
        return session

    def forget(self, session: NatsEventSession) -> None:
        with self._lock:
            self._sessions.discard(session)

    def close(self, timeout: float = _JOIN_TIMEOUT_S) -> None:
        """Close every session and stop the private loop. Idempotent.

        Close the emitter first: afterwards ``connect`` fails.
        """
        with self._lock:
            self._closed = True
            sessions = list(self._sessions)
            thread, self._loop_thread = self._loop_thread, None
        for session in sessions:
            session.close()
        if thread is not None:

            async def _close_all() -> None:
                # Let each session's shutdown (scheduled by close) finish its NATS close.
                for session in sessions:
                    nc = session._nc
                    if nc is not None:
                        await close_client(nc)

            try:
                thread.submit(_close_all()).result(timeout)
            except Exception:
                logger.debug("closing NATS connections failed", exc_info=True)
            thread.stop(timeout)
        for session in sessions:
            if not session.join(timeout):
                logger.warning("NATS command thread did not stop within %.1fs", timeout)
