"""The storage node's durable event link: cache events through NATS JetStream.

:class:`NatsEventTransport` is the emitter's
:class:`~kvmesh.storage.events.emitter.EventTransport` over a JetStream stream
instead of a gRPC call to the coordinator (DESIGN §4, "Transports"). The
coordinator reads the stream at its own pace and keeps its read position in
its checkpoint (:mod:`kvmesh.coordinator.nats_source`), so events published
while it is down or after its last checkpoint are replayed, not lost.

Wire layout (shared with the coordinator through the helpers below):

* stream ``KVMESH_EVENTS`` (configurable) over subjects ``kvmesh.events.>``,
  file storage, limits retention (max age 24 h by default), created by the
  first node that finds it missing;
* each batch is the serialized ``kvmesh.events.v1.CacheEventBatch`` published
  to ``kvmesh.events.<instance>`` with header
  ``Nats-Msg-Id: <instance_id>/<incarnation>/<seq>``, so JetStream's own
  duplicate window drops a resend whose first copy was stored but whose
  PubAck was lost, and ``Nats-Expected-Stream`` so a misconfigured server
  that routes the subject to another stream refuses it;
* coordinator commands arrive as serialized ``kvmesh.coordinator.v1.NodeCommand``
  on core-NATS subject ``kvmesh.commands.<instance>``; the node answers each
  with a serialized ``CommandResult`` on ``kvmesh.command_results.<instance>``
  (best effort: the command's effects come back as cache events in the
  stream, which is what the coordinator relies on).

``<instance>`` is :func:`subject_token` of the instance id: NATS subjects
cannot carry ``.``, ``*``, ``>`` or blanks inside one token.

Acks: a batch is acked to the emitter once JetStream answered its publish
with a PubAck (it is durably stored): ``ADMITTED``, or ``DUPLICATE`` when the
duplicate window recognised it. Publishes are pipelined and PubAcks are
delivered in seq order only, so the emitter's cumulative ack ("seq N and
everything before it") stays true. A publish error, a PubAck missing for
``ack_timeout_s`` or the connection dropping ends the session with a
:class:`~kvmesh.storage.events.emitter.TransportError`; the emitter reconnects with
backoff and resends every unacked batch (the duplicate window and, beyond it,
the coordinator's seq dedup absorb repeats).

Threads and loops: nats-py is asyncio, the emitter is threads. The transport
runs one private event loop on a daemon thread (started by the first
:meth:`NatsEventTransport.connect`). One session is one NATS connection with
reconnection disabled, so a connection that breaks ends exactly one session
and nothing buffered in a half-dead client can be published out of order
later. ``send`` only encodes on the caller's thread and queues on the loop; a
writer coroutine publishes in seq order. Acks are delivered on the loop
thread, commands on a per-session command thread (a slow delete never delays
acks).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
from google.protobuf.message import DecodeError
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import api as js_api
from nats.js.client import JetStreamContext

from kvmesh.api.coordinator.v1 import ingest_pb2
from kvmesh.common.convert import batch_to_proto
from kvmesh.common.errors import InvalidArgument
from kvmesh.common.events import CacheEventBatch, IngestResult
from kvmesh.common.nats_names import (
    DEFAULT_NATS_URL,
    DEFAULT_STREAM,
    EVENTS_SUBJECTS,
    command_results_subject,
    commands_subject,
    events_subject,
    instance_from_token,
    message_id,
    nats_error_text,
    subject_token,
)
from kvmesh.storage.events.coordinator_link import execute_command, result_to_proto
from kvmesh.storage.events.emitter import CommandResult, SessionListener, TransportError

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_NATS_URL",
    "DEFAULT_STREAM",
    "EVENTS_SUBJECTS",
    "NatsEventSession",
    "NatsEventTransport",
    "StreamSettings",
    "command_results_subject",
    "commands_subject",
    "ensure_stream",
    "events_subject",
    "instance_from_token",
    "message_id",
    "nats_error_text",
    "subject_token",
]

MSG_ID_HEADER = "Nats-Msg-Id"
EXPECTED_STREAM_HEADER = "Nats-Expected-Stream"
#: A status header on a reply: "503" means no JetStream stream answered the subject.
STATUS_HEADER = "Status"
NO_RESPONDERS = "503"
#: Room left for the HPUB headers when checking a payload against max_payload.
_HEADER_ALLOWANCE = 512
_JOIN_TIMEOUT_S = 5.0
#: JetStream's error code for "stream name already in use" (a creation race).
_STREAM_NAME_IN_USE = 10058

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StreamSettings:
    """The JetStream stream of cache events, as a node creates it when it is missing.

    ``max_age_s`` bounds how far back the coordinator can replay (a
    coordinator down longer than that, or restored from an older checkpoint,
    sees a seq gap); ``max_bytes`` 0 means no size limit. ``duplicate_window_s``
    is how long JetStream remembers a ``Nats-Msg-Id``. An existing stream is
    used as it is (the first creator's settings win).
    """

    name: str = DEFAULT_STREAM
    max_age_s: float = 24 * 3600.0
    max_bytes: int = 0
    duplicate_window_s: float = 120.0
    replicas: int = 1

    def __post_init__(self) -> None:
        if not self.name or any(c in self.name for c in ".*> \t\r\n/\\"):
            raise InvalidArgument(
                "stream name must be non-empty without '.', '*', '>', '/', '\\' or blanks",
                field="stream",
            )
        if not self.max_age_s >= 0.0:
            raise InvalidArgument("max_age_s must be >= 0 (0 = no limit)", field="max_age_s")
        if self.max_bytes < 0:
            raise InvalidArgument("max_bytes must be >= 0 (0 = no limit)", field="max_bytes")
        if not self.duplicate_window_s > 0.0:
            raise InvalidArgument("duplicate_window_s must be > 0", field="duplicate_window_s")
        if self.replicas < 1:
            raise InvalidArgument("replicas must be >= 1", field="replicas")

    def stream_config(self) -> js_api.StreamConfig:
        """The JetStream configuration of a new stream."""
        # The duplicate window may not exceed the max age (the server refuses it).
        window = self.duplicate_window_s
        if self.max_age_s:
            window = min(window, self.max_age_s)
        return js_api.StreamConfig(
            name=self.name,
            description="kvmesh cache events (kvmesh.events.<instance>)",
            subjects=[EVENTS_SUBJECTS],
            retention=js_api.RetentionPolicy.LIMITS,
            discard=js_api.DiscardPolicy.OLD,
            storage=js_api.StorageType.FILE,
            max_age=self.max_age_s or None,
            max_bytes=self.max_bytes or -1,
            duplicate_window=window,
            num_replicas=self.replicas,
        )


async def ensure_stream(js: JetStreamContext, settings: StreamSettings) -> js_api.StreamInfo:
    """The stream's info, creating it with ``settings`` when it does not exist.

    Two nodes racing to create it both succeed (the loser reads the winner's).
    A stream of that name that does not capture ``kvmesh.events.>`` is logged:
    publishes would then be refused ("expected stream does not match").
    """
    try:
        info = await js.stream_info(settings.name)
    except nats.js.errors.NotFoundError:
        try:
            info = await js.add_stream(settings.stream_config())
            logger.info(
                "created JetStream stream %s (%s, max age %gs)",
                settings.name,
                EVENTS_SUBJECTS,
                settings.max_age_s,
            )
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != _STREAM_NAME_IN_USE:
                raise  # e.g. its subjects overlap another stream's
            # Created meanwhile by another node.
            info = await js.stream_info(settings.name)
    subjects = info.config.subjects or []
    if EVENTS_SUBJECTS not in subjects:
        logger.warning(
            "JetStream stream %s has subjects %s, not %s: cache events will not land in it",
            settings.name,
            subjects,
            EVENTS_SUBJECTS,
        )
    return info


# --------------------------------------------------------------------------------------
# The private event loop
# --------------------------------------------------------------------------------------


class _LoopThread:
    """An asyncio loop on a daemon thread, for nats-py under a threaded caller."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop (any thread); RuntimeError once the loop closed."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, timeout: float) -> None:
        """Cancel what is left, stop the loop and join the thread."""

        async def _cancel_all() -> None:
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self.loop.is_closed():
            return
        try:
            self.submit(_cancel_all()).result(timeout)
        except Exception:
            logger.debug("cancelling the NATS loop's tasks failed", exc_info=True)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


# --------------------------------------------------------------------------------------
# Session
# --------------------------------------------------------------------------------------


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
        transport: NatsEventTransport,
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
        self._warned_tokens = False
        # Loop-side state (touched only on the loop thread).
        self._outbox: asyncio.Queue[tuple[int, bytes] | None] = asyncio.Queue()
        self._inflight: deque[_Inflight] = deque()
        self._by_token: dict[str, _Inflight] = {}
        self._tokens = itertools.count(1)
        self._reply_prefix = ""
        self._tasks: list[asyncio.Task[None]] = []
        # Commands run on their own thread; None ends it.
        self._commands: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._commander = threading.Thread(
            target=self._run_commands, name=f"nats-commands-{instance_id}", daemon=True
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
            await _close_client(nc)
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
            await _close_client(nc)
            raise TransportError(
                f"NATS at {t.url}: stream {t.stream.name} unavailable: {nats_error_text(exc)}"
            ) from exc
        with self._lock:
            closing = self._closing
        if closing:  # closed while we were opening
            await _close_client(nc)
            raise TransportError("the event session was closed while opening")
        self._opened = True
        self._tasks = [
            asyncio.create_task(self._write(), name=f"nats-writer-{self.instance_id}"),
            asyncio.create_task(self._watch_acks(), name=f"nats-ack-watch-{self.instance_id}"),
        ]
        self._commander.start()

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
        try:
            payload = batch_to_proto(batch).SerializeToString()
            if len(payload) <= limit:
                return payload
            problem = f"{len(payload)} bytes exceed the server's max_payload"
        except (ValueError, TypeError, OverflowError) as exc:
            problem = str(exc)
        # The emitter would resend an unpublishable batch forever. Token ids are
        # the one optional payload, so drop them rather than wedge the stream.
        if not self._warned_tokens:
            self._warned_tokens = True
            logger.error(
                "cache event batch %s does not fit NATS (%s); sending it without token ids",
                batch.ident(),
                problem,
            )
        stripped = replace(batch, entries=tuple(e._replace(token_ids=()) for e in batch.entries))
        try:
            payload = batch_to_proto(stripped).SerializeToString()
        except (ValueError, TypeError, OverflowError) as exc:
            raise TransportError(
                f"cache event batch {batch.ident()} cannot be encoded: {exc}"
            ) from exc
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
        error = _puback_error(msg)
        if error is not None:
            self._fail(TransportError(f"JetStream refused batch seq {entry.seq}: {error}"))
            return
        duplicate = bool(_puback_json(msg).get("duplicate"))
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
        self._commands.put(None)
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        nc = self._nc
        if nc is not None:
            self._loop.create_task(_close_client(nc))
        self._transport._forget(self)

    # ------------------------------------------------------------------ commands

    async def _on_command_msg(self, msg: Msg) -> None:
        if not self.closed:
            self._commands.put(msg.data)

    def _run_commands(self) -> None:
        while True:
            data = self._commands.get()
            if data is None:
                return
            if self.closed:
                logger.info("NATS event session ended; not running a queued command")
                continue
            result = self._execute(data)
            if result is None:
                continue
            payload = result_to_proto(result).SerializeToString()
            coro = self._publish_result(payload)
            try:
                future = asyncio.run_coroutine_threadsafe(coro, self._loop)
            except RuntimeError:  # the loop is gone: so is the connection
                coro.close()
                logger.warning("command %s finished after its session closed", result.command_id)
                continue
            try:
                future.result(self._transport.connect_timeout_s)
            except Exception as exc:
                logger.warning(
                    "the result of command %s (%s) could not be published: %s",
                    result.command_id,
                    result.code,
                    nats_error_text(exc),
                )

    def _execute(self, data: bytes) -> CommandResult | None:
        try:
            msg = ingest_pb2.NodeCommand.FromString(data)
        except DecodeError:
            logger.warning(
                "ignoring an undecodable command on %s", commands_subject(self.instance_id)
            )
            return None
        return execute_command(self._listener, msg)

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
        self._commands.put(None)
        if already_ended:
            return
        with contextlib.suppress(RuntimeError):  # a closed loop: nothing left to shut down
            self._loop.call_soon_threadsafe(self._shutdown_on_loop)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the command thread to end; True when it did (or never started)."""
        if self._commander.ident is not None and self._commander is not threading.current_thread():
            self._commander.join(timeout)
        return not self._commander.is_alive()


def _puback_json(msg: Msg) -> dict[str, Any]:
    try:
        parsed = json.loads(msg.data)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _puback_error(msg: Msg) -> str | None:
    """Why JetStream did not store the message, or None for a good PubAck."""
    headers = msg.headers or {}
    status = headers.get(STATUS_HEADER)
    if status == NO_RESPONDERS:
        return "no stream captures the subject (503 no responders)"
    if status:
        return f"status {status} {headers.get('Description', '')}".strip()
    resp = _puback_json(msg)
    if not resp:
        return f"unreadable PubAck {msg.data[:200]!r}"
    error = resp.get("error")
    if error:
        if isinstance(error, dict):
            return f"{error.get('code')} {error.get('description', '')}".strip()
        return str(error)
    if "seq" not in resp:
        return f"PubAck without a sequence {msg.data[:200]!r}"
    return None


def _whole_seconds(seconds: float) -> int:
    # nats-py types these timeouts as int; the caller's asyncio.wait_for keeps the exact bound.
    return max(1, math.ceil(seconds))


async def _close_client(nc: NatsClient) -> None:
    try:
        if not nc.is_closed:
            await nc.close()
    except Exception:
        logger.debug("closing a NATS connection failed", exc_info=True)


# --------------------------------------------------------------------------------------
# Transport
# --------------------------------------------------------------------------------------


class NatsEventTransport:
    """The emitter's :class:`~kvmesh.storage.events.emitter.EventTransport` over NATS JetStream.

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
        self._loop_thread: _LoopThread | None = None
        self._sessions: set[NatsEventSession] = set()
        self._closed = False

    def _loop(self) -> _LoopThread:
        with self._lock:
            if self._closed:
                raise TransportError("the NATS event transport is closed")
            if self._loop_thread is None:
                self._loop_thread = _LoopThread("nats-event-transport")
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
            self._forget(session)
            raise TransportError("the NATS event transport is closed") from exc
        try:
            # _open bounds itself; the margin covers a loop busy with other sessions.
            future.result(self.connect_timeout_s * 2 + 1.0)
        except TransportError:
            self._forget(session)
            raise
        except BaseException as exc:
            future.cancel()
            session.close()
            self._forget(session)
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

    def _forget(self, session: NatsEventSession) -> None:
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
                        await _close_client(nc)

            try:
                thread.submit(_close_all()).result(timeout)
            except Exception:
                logger.debug("closing NATS connections failed", exc_info=True)
            thread.stop(timeout)
        for session in sessions:
            if not session.join(timeout):
                logger.warning("NATS command thread did not stop within %.1fs", timeout)
