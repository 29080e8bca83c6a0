"""The coordinator's durable event source: the NATS JetStream stream of cache events.

Storage nodes started with ``--event-transport nats`` publish their batches to
a JetStream stream (:mod:`kvmesh.storage.events.nats_link`: stream
``KVMESH_EVENTS``, subjects ``kvmesh.events.<instance>``). :class:`NatsEventSource`
reads that stream in order and feeds every batch to the core's gate, exactly
like the gRPC ingest service does for nodes that stream to it; both may run
in one fleet.

This module is the JetStream consumer: sessions, reconnects and the pull
loop. Its parts are beside it — the read position (:mod:`.position`, a
checkpoint section), applying messages to the core (:mod:`.apply`), commands
to nodes (:mod:`.commands`) and the mixed-fleet dispatcher
(:mod:`.dispatch`).

* After a restart from a checkpoint the source resumes at the checkpointed
  position and replays everything published since; what the checkpoint
  already held comes back as DUPLICATE from the gate's seq dedup. A cold
  start (no checkpoint, or a checkpoint of another stream) replays the whole
  retained stream;
* the consumer is an ephemeral, unacknowledged pull consumer created at the
  position on every (re)connect and deleted when the session ends; the
  consumer sequence of each delivery is checked, so a lost delivery makes the
  source recreate it from its position instead of skipping silently.

The source runs as an asyncio task on the coordinator's loop; the per-message
work (decode, validate, ingest) runs on one dedicated thread, a chunk of
messages at a time, so a long replay never stalls the gRPC services.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import api as js_api
from nats.js.client import JetStreamContext

from kvmesh.api.coordinator.v1 import ingest_pb2
from kvmesh.common.events import Tier
from kvmesh.common.keys import ObjectKey
from kvmesh.common.nats_names import EVENTS_SUBJECTS, nats_error_text
from kvmesh.coordinator.core.coordinator import Coordinator
from kvmesh.coordinator.sources.apply import Delivery, StreamApplier
from kvmesh.coordinator.sources.commands import RESULTS_SUBJECTS, NatsCommands
from kvmesh.coordinator.sources.position import NatsStreamPosition
from kvmesh.coordinator.sources.settings import NatsSourceSettings, NatsSourceStats

logger = logging.getLogger(__name__)

_STATUS = "Status"
_DESCRIPTION = "Description"
#: Pull-request statuses that end one request normally (no messages / expired).
_REQUEST_DONE = frozenset({"404", "408"})
_HEARTBEAT = "100"
_LOST = object()


class _ConsumerLost(Exception):
    """The pull consumer or its connection stopped delivering; rebuild from the position."""


class NatsEventSource:
    """Reads the JetStream stream of cache events into ``core`` (module docstring).

    Build it before ``core.load_state()`` (it registers its position as a
    checkpoint component), :meth:`start` it on the coordinator's event loop
    after ``core.start()``, :meth:`stop` it before ``core.stop()`` (whose
    final checkpoint then holds the final position). ``on_command_result``
    receives ``(instance_id, CommandResult)`` for every result a node
    publishes (on the loop thread; keep it quick), ``on_command_sent``
    ``(instance_id, NodeCommand)`` for every command published.
    """

    def __init__(
        self,
        core: Coordinator,
        settings: NatsSourceSettings,
        *,
        on_command_result: Callable[[str, ingest_pb2.CommandResult], None] | None = None,
        on_command_sent: Callable[[str, ingest_pb2.NodeCommand], None] | None = None,
    ) -> None:
        self.settings = settings
        self.position = NatsStreamPosition(settings.stream)
        core.checkpoint_components.append(self.position)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._nc: NatsClient | None = None
        self._stopping = threading.Event()
        self._executor: ThreadPoolExecutor | None = None
        self._applying: asyncio.Future[None] | None = None
        self._commands = NatsCommands(on_command_result, on_command_sent)
        self._applier = StreamApplier(
            core,
            self.position,
            self._stopping,
            self._commands.send_command,
            resync_unknown=settings.resync_unknown,
        )
        # Session counters (written on the loop, read anywhere).
        self._sessions = 0
        self._consumer_resets = 0
        self._last_error = ""

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start reading (idempotent); never fails for an unreachable NATS, it retries."""
        if self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._commands.attach(None, self._loop)
        self._stopping.clear()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nats-ingest")
        self._task = asyncio.create_task(self._run(), name="nats-event-source")
        logger.info(
            "reading cache events from NATS %s stream %s (from %s)",
            self.settings.url,
            self.settings.stream,
            f"seq {self.position.next_seq}" if self.position.next_seq else "its first message",
        )

    async def stop(self) -> None:
        """Stop reading; returns once no message is being applied any more. Idempotent."""
        task, self._task = self._task, None
        self._stopping.set()
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        applying = self._applying
        if applying is not None and not applying.done():
            # The ingest thread stops after its current message; wait so the
            # caller's final checkpoint sees a settled position.
            with contextlib.suppress(Exception):
                await applying
        nc, self._nc = self._nc, None
        self._commands.attach(None, self._loop)
        if nc is not None:
            await _close_client(nc)
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False)

    @property
    def connected(self) -> bool:
        """True while a NATS connection is up and the stream is being read."""
        nc = self._nc
        return nc is not None and nc.is_connected

    def stats(self) -> NatsSourceStats:
        """Counters and position, read without stopping anything."""
        a = self._applier.counts()
        with self._lock:
            return NatsSourceStats(
                connected=self.connected,
                stream=self.settings.stream,
                next_seq=self.position.next_seq,
                pending=a.pending,
                applied=a.applied,
                skipped=a.skipped,
                admitted=a.admitted,
                duplicate=a.duplicate,
                stale=a.stale,
                sessions=self._sessions,
                consumer_resets=self._consumer_resets,
                commands_sent=self._commands.sent,
                command_results=self._commands.results,
                resyncs_requested=a.resyncs,
                last_error=self._last_error,
            )

    def metrics(self) -> dict[str, Any]:
        """The stats as the nested dict :data:`NATS_SERIES` reads."""
        s = self.stats()
        return {
            "connected": 1 if s.connected else 0,
            "next_seq": s.next_seq,
            "pending": s.pending,
            "messages": {
                "admitted": s.admitted,
                "duplicate": s.duplicate,
                "stale": s.stale,
                "skipped": s.skipped,
            },
            "commands_sent": s.commands_sent,
        }

    # ------------------------------------------------------------------ session loop

    async def _run(self) -> None:
        s = self.settings
        delay = s.reconnect_base_s
        failures = 0
        while not self._stopping.is_set():
            applied_before = self._applier.applied
            try:
                await self._serve()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures += 1
                text = exc.args[0] if isinstance(exc, _ConsumerLost) else nats_error_text(exc)
                with self._lock:
                    self._last_error = str(text)
                # An outage must not flood the log at the backoff rate.
                level = logging.WARNING if failures == 1 or failures % 50 == 0 else logging.DEBUG
                logger.log(level, "NATS event source: %s (%d failures so far)", text, failures)
            # A session that applied something was healthy: retry quickly.
            if self._applier.applied > applied_before:
                delay, failures = s.reconnect_base_s, 0
            await asyncio.sleep(delay * (1.0 - 0.2 * random.random()))
            delay = min(delay * 2.0, s.reconnect_max_s)

    async def _serve(self) -> None:
        """One connection: read until it fails (or the source stops)."""
        s = self.settings
        nc = NatsClient()
        lost: asyncio.Queue[object] = asyncio.Queue()

        async def on_closed() -> None:
            lost.put_nowait(_LOST)

        async def on_error(exc: Exception) -> None:
            logger.debug("NATS client error in the event source: %s", exc)

        try:
            await asyncio.wait_for(
                nc.connect(
                    s.url,
                    name="kvmesh-coordinator",
                    connect_timeout=max(1, math.ceil(s.connect_timeout_s)),
                    # Reconnection is ours: every session restarts from the position.
                    allow_reconnect=False,
                    max_reconnect_attempts=1,
                    reconnect_time_wait=0,
                    error_cb=on_error,
                    disconnected_cb=on_closed,
                    closed_cb=on_closed,
                ),
                timeout=s.connect_timeout_s,
            )
        except BaseException:
            await _close_client(nc)
            raise
        try:
            self._nc = nc
            self._commands.attach(nc, self._loop)
            with self._lock:
                self._sessions += 1
            await nc.subscribe(RESULTS_SUBJECTS, cb=self._commands.on_result)
            js = nc.jetstream(timeout=s.connect_timeout_s)
            info = await self._wait_for_stream(js, lost)
            start = self._start_seq(info)
            await self._consume(nc, js, start, lost)
        finally:
            if self._nc is nc:
                self._nc = None
                self._commands.attach(None, self._loop)
            await _close_client(nc)

    async def _wait_for_stream(
        self, js: JetStreamContext, lost: asyncio.Queue[object]
    ) -> js_api.StreamInfo:
        """The stream's info; waits (polling) until a node has created it."""
        warned = False
        while True:
            try:
                return await js.stream_info(self.settings.stream)
            except nats.js.errors.NotFoundError:
                if not warned:
                    warned = True
                    logger.info(
                        "NATS stream %s does not exist yet; waiting for a node to create it",
                        self.settings.stream,
                    )
            if not lost.empty():
                raise _ConsumerLost("the NATS connection was lost")
            await asyncio.sleep(self.settings.pull_expires_s / 4)

    def _start_seq(self, info: js_api.StreamInfo) -> int:
        """Where to resume in the stream (0 = its first message), checking the position."""
        name = self.settings.stream
        created = info.created.isoformat() if info.created is not None else ""
        stream, next_seq, known_created = self.position.snapshot()
        first, last = info.state.first_seq, info.state.last_seq
        if stream != name or next_seq == 0:
            if stream != name and next_seq:
                logger.warning(
                    "the checkpointed NATS position belongs to stream %s, not %s: replaying %s",
                    stream,
                    name,
                    name,
                )
            self.position.reset(name, created)
            return 0
        if known_created and created and known_created != created:
            logger.warning(
                "NATS stream %s was created again since the checkpoint (%s, was %s): "
                "replaying it from its first message",
                name,
                created,
                known_created,
            )
            self.position.reset(name, created)
            return 0
        if next_seq > last + 1:
            logger.warning(
                "NATS stream %s ends at seq %d but the position is %d (stream replaced?): "
                "replaying it from its first message",
                name,
                last,
                next_seq,
            )
            self.position.reset(name, created)
            return 0
        if first > next_seq and info.state.messages:
            logger.warning(
                "NATS stream %s lost seqs %d..%d to its retention limits before they were "
                "applied; the gate will flag the emitters' gaps",
                name,
                next_seq,
                first - 1,
            )
        self.position.bind(created)
        return next_seq

    async def _consume(
        self, nc: NatsClient, js: JetStreamContext, start: int, inbox_q: asyncio.Queue[object]
    ) -> None:
        """Pull the stream from ``start`` until the connection or the consumer fails."""
        s = self.settings
        name = f"kvmesh-coordinator-{uuid.uuid4().hex[:16]}"
        config = js_api.ConsumerConfig(
            name=name,
            deliver_policy=(
                js_api.DeliverPolicy.BY_START_SEQUENCE if start else js_api.DeliverPolicy.ALL
            ),
            opt_start_seq=start or None,
            ack_policy=js_api.AckPolicy.NONE,
            filter_subject=EVENTS_SUBJECTS,
            inactive_threshold=s.consumer_inactive_s,
            mem_storage=True,
            num_replicas=1,
        )
        await js.add_consumer(s.stream, config=config)
        inbox = nc.new_inbox()

        async def deliver(msg: Msg) -> None:
            inbox_q.put_nowait(msg)

        # Room for one whole pull request: a bounded subscription would drop
        # deliveries beyond its limits (and the consumer-seq check would then
        # rebuild the consumer over and over).
        await nc.subscribe(
            inbox,
            cb=deliver,
            pending_msgs_limit=2 * s.fetch_batch + 16,
            pending_bytes_limit=s.fetch_batch * max(nc.max_payload, 1 << 20) + (1 << 20),
        )
        next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{s.stream}.{name}"
        request = json.dumps(
            {"batch": s.fetch_batch, "expires": int(s.pull_expires_s * 1e9)}
        ).encode()
        silence = s.pull_expires_s + s.connect_timeout_s
        expected_cseq = 1
        try:
            await nc.publish(next_subject, request, reply=inbox)
            outstanding = s.fetch_batch
            while not self._stopping.is_set():
                try:
                    item = await asyncio.wait_for(inbox_q.get(), silence)
                except TimeoutError:
                    raise _ConsumerLost(
                        f"no answer from consumer {name} for {silence:g}s"
                    ) from None
                chunk: list[Delivery] = []
                request_done = False
                while True:
                    if item is _LOST:
                        raise _ConsumerLost("the NATS connection was lost")
                    assert isinstance(item, Msg)
                    headers = item.headers or {}
                    status = headers.get(_STATUS)
                    if status is None:
                        md = item.metadata
                        if md.sequence.consumer != expected_cseq:
                            with self._lock:
                                self._consumer_resets += 1
                            # Deliver what arrived in order, then rebuild from the position.
                            if chunk:
                                await self._apply_chunk(chunk)
                            raise _ConsumerLost(
                                f"consumer {name} delivered #{md.sequence.consumer}, expected "
                                f"#{expected_cseq}: recreating it at the position"
                            )
                        expected_cseq += 1
                        chunk.append(
                            Delivery(md.sequence.stream, item.subject, item.data, md.num_pending)
                        )
                        outstanding -= 1
                        request_done = outstanding == 0
                    elif status in _REQUEST_DONE:
                        request_done = True
                    elif status != _HEARTBEAT:
                        raise _ConsumerLost(
                            f"consumer {name}: status {status} {headers.get(_DESCRIPTION, '')}"
                        )
                    if request_done or inbox_q.empty():
                        break
                    item = inbox_q.get_nowait()
                if request_done:
                    # Ask for the next messages before applying these, so they
                    # travel while the ingest thread works.
                    await nc.publish(next_subject, request, reply=inbox)
                    outstanding = s.fetch_batch
                if chunk:
                    await self._apply_chunk(chunk)
        finally:
            if nc.is_connected:
                with contextlib.suppress(Exception):
                    await js.delete_consumer(s.stream, name)

    # ------------------------------------------------------------------ applying and commands

    async def _apply_chunk(self, chunk: Sequence[Delivery]) -> None:
        loop = asyncio.get_running_loop()
        executor = self._executor
        if executor is None:
            raise _ConsumerLost("the source is stopping")
        future = loop.run_in_executor(executor, self._applier.apply, chunk)
        self._applying = future
        # Shielded: cancelling the source must not abandon a chunk half-applied
        # behind stop()'s back (stop waits for it instead).
        await asyncio.shield(future)

    def send_command(self, instance_id: str, command: ingest_pb2.NodeCommand) -> bool:
        """Publish ``command`` to the node (any thread, never blocks); False when not connected.

        A missing ``command_id`` is filled in. Delivery is best effort (core
        NATS): a node that is not subscribed right now never sees it.
        """
        return self._commands.send_command(instance_id, command)

    def dispatch_delete(
        self,
        instance_id: str,
        tier: Tier,
        backend: str,
        keys: Sequence[ObjectKey],
        force: bool = False,
    ) -> str:
        """The core's ``DeleteDispatcher`` over NATS: a ``DeleteKeysCommand``; its id."""
        return self._commands.dispatch_delete(instance_id, tier, backend, keys, force)

    def dispatch_resync(self, instance_id: str) -> bool:
        """The core's ``ResyncDispatcher`` over NATS: a ``ResyncCommand`` per tier."""
        return self._commands.dispatch_resync(instance_id)


async def _close_client(nc: NatsClient) -> None:
    try:
        if not nc.is_closed:
            await nc.close()
    except Exception:
        logger.debug("closing a NATS connection failed", exc_info=True)
