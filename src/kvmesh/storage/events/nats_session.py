"""One NATS session of the storage node's event link: a connection, its batches and commands.

Opened by :class:`~kvmesh.storage.events.nats_transport.NatsEventTransport`
(which says how acks, reconnects and threads work: docs/events.md,
"Transports"). A session is one NATS connection with reconnection disabled;
``send`` encodes on the caller's thread and queues on the transport's loop,
where a writer publishes in seq order and PubAcks are delivered in seq order.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import threading
import time
from collections import deque
from typing import Protocol

from google.protobuf.message import DecodeError
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from kvmesh.api.coordinator.v1 import ingest_pb2
from kvmesh.common.events import CacheEventBatch, IngestResult
from kvmesh.common.nats_names import (
    command_results_subject,
    commands_subject,
    events_subject,
    message_id,
    nats_error_text,
)
from kvmesh.storage.events.codec import BatchEncoder, result_to_proto
from kvmesh.storage.events.commands import CommandExecutor
from kvmesh.storage.events.jetstream import (
    EXPECTED_STREAM_HEADER,
    MSG_ID_HEADER,
    StreamSettings,
    ensure_stream,
    puback_error,
    puback_is_duplicate,
)
from kvmesh.storage.events.transport import CommandResult, SessionListener, TransportError

logger = logging.getLogger(__name__)

__all__ = ["NatsEventSession", "SessionOwner", "close_client"]

#: Room left for the HPUB headers when checking a payload against max_payload.
_HEADER_ALLOWANCE = 512


class SessionOwner(Protocol):
    """What a session needs of the transport that opened it."""

    url: str
    stream: StreamSettings
    connect_timeout_s: float
    ack_timeout_s: float
    create_stream: bool

    def forget(self, session: NatsEventSession) -> None:
        """The session ended: drop it from the transport's open sessions."""


class _Inflight:
    """A published batch waiting for its PubAck."""

    __slots__ = ("result", "sent_at", "seq")

    def __init__(self, seq: int, sent_at: float) -> None:
        self.seq = seq
        self.sent_at = sent_at
        self.result: IngestResult | None = None


class NatsEventSession:
    """One NATS connection carrying one emitter's batches up and commands down.

    Created by :meth:`NatsEventTransport.connect`; the emitter's sender thread
    calls :meth:`send`, anyone may call :meth:`close`.
    """

    def __init__(
        self,
        transport: SessionOwner,
        loop: asyncio.AbstractEventLoop,
        instance_id: str,
        incarnation: int,
        listener: SessionListener,
    ) -> None:
        self.instance_id = instance_id
        self.incarnation = incarnation
        self._transport = transport
        self._loop = loop
        self._listener = listener
        self._subject = events_subject(instance_id)
        self._headers_base = {EXPECTED_STREAM_HEADER: transport.stream.name}
        self._lock = threading.Lock()
        self._closing = False  # close() was called
        self._ended = False  # over, for whatever reason
        self._opened = False  # _open succeeded: connection events count from now on
        self._nc: NatsClient | None = None
        self._max_payload = 1 << 20
        self._encoder = BatchEncoder("NATS")
        # Loop-side state (touched only on the loop thread).
        self._outbox: asyncio.Queue[tuple[int, bytes] | None] = asyncio.Queue()
        self._inflight: deque[_Inflight] = deque()
        self._by_token: dict[str, _Inflight] = {}
        self._tokens = itertools.count(1)
        self._reply_prefix = ""
        self._tasks: list[asyncio.Task[None]] = []
        self._commands = CommandExecutor(
            listener, self._send_result, name=f"nats-commands-{instance_id}"
        )

    # ------------------------------------------------------------------ opening (loop)

    async def _open(self) -> None:
        """Connect, make sure the stream exists, subscribe; TransportError on failure."""
        t = self._transport
        nc = NatsClient()
        self._nc = nc
        try:
            await asyncio.wait_for(
                nc.connect(
                    t.url,
                    name=f"kvmesh-storage-{self.instance_id}",
                    connect_timeout=_whole_seconds(t.connect_timeout_s),
                    # One connection per session: a broken one ends the session
                    # (see the module docstring), the emitter reconnects.
                    allow_reconnect=False,
                    max_reconnect_attempts=1,
                    reconnect_time_wait=0,
                    error_cb=self._on_nats_error,
                    disconnected_cb=self._on_disconnected,
                    closed_cb=self._on_disconnected,
                ),
                timeout=t.connect_timeout_s,
            )
        except Exception as exc:
            await close_client(nc)
            raise TransportError(
                f"cannot connect to NATS at {t.url}: {nats_error_text(exc)}"
            ) from exc
        try:
            js = nc.jetstream(timeout=t.connect_timeout_s)
            if t.create_stream:
                await ensure_stream(js, t.stream)
            else:
                await js.stream_info(t.stream.name)
            self._max_payload = nc.max_payload
            self._reply_prefix = nc.new_inbox()
            await nc.subscribe(f"{self._reply_prefix}.*", cb=self._on_puback)
            await nc.subscribe(commands_subject(self.instance_id), cb=self._on_command_msg)
            # The subscriptions must be on the server before the first command or
            # PubAck could be sent to them.
            await nc.flush(timeout=_whole_seconds(t.connect_timeout_s))
        except Exception as exc:
            await close_client(nc)
            raise TransportError(
                f"NATS at {t.url}: stream {t.stream.name} unavailable: {nats_error_text(exc)}"
            ) from exc
        with self._lock:
            closing = self._closing
        if closing:  # closed while we were opening
            await close_client(nc)
            raise TransportError("the event session was closed while opening")
        self._opened = True
        self._tasks = [
            asyncio.create_task(self._write(), name=f"nats-writer-{self.instance_id}"),
            asyncio.create_task(self._watch_acks(), name=f"nats-ack-watch-{self.instance_id}"),
        ]

    # ------------------------------------------------------------------ writing

    @property
    def closed(self) -> bool:
        """True once the session ended or :meth:`close` was called."""
        with self._lock:
            return self._ended or self._closing

    def send(self, batch: CacheEventBatch) -> None:
        """Encode ``batch`` and queue its publish (never blocks); TransportError when over."""
        payload = self._encode(batch)
        with self._lock:
            if self._ended or self._closing:
                raise TransportError("the NATS event session is closed")
            try:
                self._loop.call_soon_threadsafe(self._outbox.put_nowait, (batch.seq, payload))
            except RuntimeError as exc:  # the loop is closed: the transport is gone
                raise TransportError("the NATS event transport is closed") from exc

    def _encode(self, batch: CacheEventBatch) -> bytes:
        limit = self._max_payload - _HEADER_ALLOWANCE
        payload = self._encoder.to_bytes(batch, limit)
        if len(payload) > limit:
            raise TransportError(
                f"cache event batch {batch.ident()} is {len(payload)} bytes, over the NATS "
                f"server's max_payload {self._max_payload} (raise max_payload or lower "
                "the emitter's max_entries_per_batch)"
            )
        return payload

    async def _write(self) -> None:
        """Publish queued batches one after another, so the stream keeps seq order."""
        nc = self._nc
        assert nc is not None
        try:
            while True:
                item = await self._outbox.get()
                if item is None:
                    return
                seq, payload = item
                token = str(next(self._tokens))
                entry = _Inflight(seq, time.monotonic())
                self._by_token[token] = entry
                self._inflight.append(entry)
                headers = dict(self._headers_base)
                headers[MSG_ID_HEADER] = message_id(self.instance_id, self.incarnation, seq)
                await nc.publish(
                    self._subject, payload, reply=f"{self._reply_prefix}.{token}", headers=headers
                )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail(TransportError(f"NATS publish failed: {nats_error_text(exc)}"))

    # ------------------------------------------------------------------ acks (loop)

    async def _on_puback(self, msg: Msg) -> None:
        token = msg.subject.rsplit(".", 1)[-1]
        entry = self._by_token.pop(token, None)
        if entry is None or self._ended:
            return
        error = puback_error(msg)
        if error is not None:
            self._fail(TransportError(f"JetStream refused batch seq {entry.seq}: {error}"))
            return
        duplicate = puback_is_duplicate(msg)
        entry.result = IngestResult.DUPLICATE if duplicate else IngestResult.ADMITTED
        # Acks leave in seq order only: the emitter reads an ack for N as
        # "everything up to N is delivered", and PubAcks could overtake each other.
        inflight = self._inflight
        while inflight and inflight[0].result is not None:
            done = inflight.popleft()
            assert done.result is not None
            try:
                self._listener.on_ack(done.seq, done.result)
            except Exception:
                logger.exception("on_ack failed for seq %d", done.seq)

    async def _watch_acks(self) -> None:
        """End the session when the oldest publish has no PubAck within ack_timeout_s."""
        timeout = self._transport.ack_timeout_s
        while True:
            await asyncio.sleep(min(0.25, timeout / 4))
            if self._inflight:
                oldest = self._inflight[0]
                waited = time.monotonic() - oldest.sent_at
                if waited >= timeout:
                    self._fail(
                        TransportError(
                            f"no JetStream PubAck for seq {oldest.seq} within {timeout:g}s"
                        )
                    )
                    return

    # ------------------------------------------------------------------ connection events

    async def _on_nats_error(self, exc: Exception) -> None:
        # nats-py reports connect retries and parse problems here; the session
        # ends through the disconnected/closed callbacks, so this is only logged.
        logger.debug("NATS client error on the event session of %s: %s", self.instance_id, exc)

    async def _on_disconnected(self) -> None:
        # Before _open finished, its own error path reports the failure (to connect()).
        if self._opened:
            self._fail(TransportError("the NATS connection was lost"))

    def _fail(self, error: TransportError) -> None:
        """End the session (loop thread) and tell the listener once, unless closed by owner."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
            closed_by_owner = self._closing
        self._shutdown_on_loop()
        if closed_by_owner:
            return
        logger.info("NATS event session of %s ended: %s", self.instance_id, error)
        try:
            self._listener.on_closed(error)
        except Exception:
            logger.exception("on_closed failed")

    def _shutdown_on_loop(self) -> None:
        self._outbox.put_nowait(None)
        self._commands.close()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        nc = self._nc
        if nc is not None:
            self._loop.create_task(close_client(nc))
        self._transport.forget(self)

    # ------------------------------------------------------------------ commands

    async def _on_command_msg(self, msg: Msg) -> None:
        if self.closed:
            return
        try:
            command = ingest_pb2.NodeCommand.FromString(msg.data)
        except DecodeError:
            logger.warning(
                "ignoring an undecodable command on %s", commands_subject(self.instance_id)
            )
            return
        self._commands.submit(command)

    def _send_result(self, result: CommandResult) -> None:
        """Publish a command's result (on the command executor's worker; bounded wait)."""
        payload = result_to_proto(result).SerializeToString()
        coro = self._publish_result(payload)
        try:
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        except RuntimeError:  # the loop is gone: so is the connection
            coro.close()
            logger.warning("command %s finished after its session closed", result.command_id)
            return
        try:
            future.result(self._transport.connect_timeout_s)
        except Exception as exc:
            logger.warning(
                "the result of command %s (%s) could not be published: %s",
                result.command_id,
                result.code,
                nats_error_text(exc),
            )

    async def _publish_result(self, payload: bytes) -> None:
        nc = self._nc
        if nc is None or self._ended:
            raise TransportError("the NATS event session is closed")
        await nc.publish(command_results_subject(self.instance_id), payload)

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """End the session without notifying the listener; idempotent, any thread, never blocks.

        Batches queued but not yet acked are left to the emitter, which
        resends them on its next session.
        """
        with self._lock:
            if self._closing:
                return
            self._closing = True
            already_ended = self._ended
            self._ended = True
        self._commands.close()
        if already_ended:
            return
        with contextlib.suppress(RuntimeError):  # a closed loop: nothing left to shut down
            self._loop.call_soon_threadsafe(self._shutdown_on_loop)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the command thread to end; True when none is left (or none ever ran)."""
        return self._commands.join(timeout)


def _whole_seconds(seconds: float) -> int:
    # nats-py types these timeouts as int; the caller's asyncio.wait_for keeps the exact bound.
    return max(1, math.ceil(seconds))


async def close_client(nc: NatsClient) -> None:
    try:
        if not nc.is_closed:
            await nc.close()
    except Exception:
        logger.debug("closing a NATS connection failed", exc_info=True)
