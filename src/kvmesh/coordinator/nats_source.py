"""The coordinator's durable event source: the NATS JetStream stream of cache events.

Storage nodes started with ``--event-transport nats`` publish their batches to
a JetStream stream (:mod:`kvmesh.storage.events.nats_link`: stream
``KVMESH_EVENTS``, subjects ``kvmesh.events.<instance>``). :class:`NatsEventSource`
reads that stream in order and feeds every batch to the core's gate, exactly
like the gRPC ingest servicer does for nodes that stream to it; both may run
in one fleet.

Positions are kvmesh's, not NATS's (reference §3.3, LMCache's Kafka group that
never commits):

* the read position is :class:`NatsStreamPosition`, a checkpoint section
  ``nats_stream_position`` = ``{"stream": name, "next_seq": N, "created": ts}``
  (``next_seq`` 0: from the stream's first message). It is registered in the
  core's checkpoint components when the source is built, before the core
  loads its checkpoint, so it is captured under the same quiesce as the
  cursors and the directory;
* each message is applied (decode → validate → ``core.ingest_validated``)
  *before* the position moves past it, so a checkpoint never holds a position
  beyond what its directory contains. After a restart from a checkpoint the
  source resumes at the checkpointed position and replays everything
  published since; what the checkpoint already held comes back as
  DUPLICATE from the gate's seq dedup. A cold start (no checkpoint, or a
  checkpoint of another stream) replays the whole retained stream;
* the consumer is an ephemeral, unacknowledged pull consumer created at the
  position on every (re)connect and deleted when the session ends; the
  consumer sequence of each delivery is checked, so a lost delivery makes the
  source recreate it from its position instead of skipping silently;
* a message that cannot be decoded or validated, or whose subject does not
  name its batch's instance, is logged and skipped, and the position still
  moves past it: one bad publisher never wedges the stream.

Commands to nodes go to ``kvmesh.commands.<instance>`` (core NATS, best
effort: the node reports the effects as DELETE events in the stream);
results come back on ``kvmesh.command_results.<instance>`` and go to
``on_command_result``. :class:`PreferStreamDispatcher` is the core's
``DeleteDispatcher`` for a mixed fleet: a node's gRPC stream when it has one,
NATS otherwise.

When the first batch the source sees from an instance has ``seq > 1`` and the
gate holds no cursor for it (the stream's retention already dropped its
beginning), the node is asked to resync both tiers, as the gRPC servicer does
for an unknown node opening a stream.

The source runs as an asyncio task on the coordinator's loop; the per-message
work (decode, validate, ingest) runs on one dedicated thread, a chunk of
messages at a time, so a long replay never stalls the gRPC services.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import random
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import nats.errors
import nats.js.errors
from google.protobuf.message import DecodeError
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import api as js_api
from nats.js.client import JetStreamContext
from opentelemetry import trace

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.coordinator.v1 import ingest_pb2
from kvmesh.api.events.v1 import events_pb2
from kvmesh.common.convert import validated_batch_from_proto
from kvmesh.common.errors import InvalidArgument, KvmeshError
from kvmesh.common.events import CacheEventBatch, IngestResult, Tier
from kvmesh.common.keys import ObjectKey
from kvmesh.common.nats_names import (
    COMMAND_RESULTS_ROOT,
    DEFAULT_STREAM,
    EVENTS_SUBJECTS,
    commands_subject,
    events_subject,
    instance_from_token,
    nats_error_text,
)
from kvmesh.coordinator import traced_ingest
from kvmesh.coordinator.core.coordinator import Coordinator
from kvmesh.coordinator.core.persistence import PersistenceType
from kvmesh.coordinator.servicer import delete_command
from kvmesh.rpc.metrics import Series

logger = logging.getLogger(__name__)

__all__ = [
    "NATS_SERIES",
    "POSITION_SECTION",
    "NatsEventSource",
    "NatsSourceSettings",
    "NatsSourceStats",
    "NatsStreamPosition",
    "PreferStreamDispatcher",
]

POSITION_SECTION = "nats_stream_position"
_STATUS = "Status"
_DESCRIPTION = "Description"
#: Pull-request statuses that end one request normally (no messages / expired).
_REQUEST_DONE = frozenset({"404", "408"})
_HEARTBEAT = "100"
_tracer = trace.get_tracer("kvmesh.coordinator")


class _ConsumerLost(Exception):
    """The pull consumer or its connection stopped delivering; rebuild from the position."""


# --------------------------------------------------------------------------------------
# Settings, position, stats
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NatsSourceSettings:
    """How the coordinator reads the event stream.

    ``fetch_batch`` messages are requested per pull, each pull lasting at
    most ``pull_expires_s`` (an idle stream costs one request per period);
    no answer at all for ``pull_expires_s + connect_timeout_s`` means the
    connection or consumer died. Reconnects back off from
    ``reconnect_base_s`` doubling to ``reconnect_max_s``. The ephemeral
    consumer of a coordinator that died is removed by NATS after
    ``consumer_inactive_s``. ``resync_unknown`` asks a node whose history the
    stream no longer holds to re-announce its placements.
    """

    url: str
    stream: str = DEFAULT_STREAM
    connect_timeout_s: float = 2.0
    fetch_batch: int = 256
    pull_expires_s: float = 2.0
    reconnect_base_s: float = 0.1
    reconnect_max_s: float = 5.0
    consumer_inactive_s: float = 30.0
    resync_unknown: bool = True

    def __post_init__(self) -> None:
        if not self.url:
            raise InvalidArgument("the NATS url must not be empty", field="nats_url")
        if not self.stream or any(c in self.stream for c in ".*> \t\r\n/\\"):
            raise InvalidArgument("invalid JetStream stream name", field="nats_stream")
        if self.fetch_batch < 1:
            raise InvalidArgument("fetch_batch must be >= 1", field="fetch_batch")
        for name in ("connect_timeout_s", "pull_expires_s", "consumer_inactive_s"):
            if not 0.0 < getattr(self, name) < math.inf:
                raise InvalidArgument(f"{name} must be finite and > 0", field=name)
        if not 0.0 < self.reconnect_base_s <= self.reconnect_max_s:
            raise InvalidArgument(
                "need 0 < reconnect_base_s <= reconnect_max_s", field="reconnect_base_s"
            )


class _Position(NamedTuple):
    stream: str
    next_seq: int
    created: str


class NatsStreamPosition:
    """The source's read position: a checkpoint ``DurableComponent`` (module docstring).

    ``next_seq`` is the stream sequence of the next message to apply (0 =
    the stream's first message); ``created`` is the stream's creation time
    as the server reports it, so a stream deleted and created again under the
    same name is not mistaken for the one the position belongs to. Restore
    replaces (like LMCache's ``kafka_stream_position``). Thread-safe.
    """

    name = POSITION_SECTION
    persistence_type = PersistenceType.CHECKPOINT

    def __init__(self, stream: str) -> None:
        self._lock = threading.Lock()
        self._pos = _Position(stream, 0, "")
        self.restored = False

    @property
    def stream(self) -> str:
        """The stream this position belongs to."""
        with self._lock:
            return self._pos.stream

    @property
    def next_seq(self) -> int:
        """The stream sequence of the next message to apply (0 = from the first)."""
        with self._lock:
            return self._pos.next_seq

    @property
    def created(self) -> str:
        """The stream's creation time, when known ("" otherwise)."""
        with self._lock:
            return self._pos.created

    def snapshot(self) -> tuple[str, int, str]:
        """``(stream, next_seq, created)`` read together."""
        with self._lock:
            return self._pos

    def advance(self, next_seq: int) -> None:
        """Move to ``next_seq`` (never backwards)."""
        with self._lock:
            if next_seq > self._pos.next_seq:
                self._pos = self._pos._replace(next_seq=next_seq)

    def reset(self, stream: str, created: str) -> None:
        """Start over at the first message of ``stream`` (created at ``created``)."""
        with self._lock:
            self._pos = _Position(stream, 0, created)

    def bind(self, created: str) -> None:
        """Remember the creation time of the stream being read (when not known yet)."""
        with self._lock:
            if not self._pos.created:
                self._pos = self._pos._replace(created=created)

    def capture(self) -> dict[str, object]:
        """``{"stream": name, "next_seq": N, "created": ts}``."""
        with self._lock:
            pos = self._pos
        return {"stream": pos.stream, "next_seq": pos.next_seq, "created": pos.created}

    def restore(self, state: object) -> None:
        """Replace the position with a capture (ValueError when malformed)."""
        if not isinstance(state, dict):
            raise ValueError(f"{POSITION_SECTION}: expected a map, got {type(state).__name__}")
        stream = state.get("stream")
        next_seq = state.get("next_seq")
        created = state.get("created", "")
        if not isinstance(stream, str) or not stream:
            raise ValueError(f"{POSITION_SECTION}: 'stream' must be a non-empty string")
        if type(next_seq) is not int or next_seq < 0:
            raise ValueError(f"{POSITION_SECTION}: 'next_seq' must be an int >= 0")
        if not isinstance(created, str):
            raise ValueError(f"{POSITION_SECTION}: 'created' must be a string")
        with self._lock:
            self._pos = _Position(stream, next_seq, created)
            self.restored = True


@dataclass(frozen=True, slots=True)
class NatsSourceStats:
    """A snapshot of the source (for metrics, status and tests).

    ``pending`` is how many messages the stream held beyond the last one
    applied, as of that message (0 = caught up then); ``skipped`` counts
    messages that could not be decoded, validated or ingested.
    """

    connected: bool
    stream: str
    next_seq: int
    pending: int
    applied: int
    skipped: int
    admitted: int
    duplicate: int
    stale: int
    sessions: int
    consumer_resets: int
    commands_sent: int
    command_results: int
    resyncs_requested: int
    last_error: str


NATS_SERIES = [
    Series("kvmesh_coordinator_nats_connected", "1 while reading the NATS stream.", "connected"),
    Series("kvmesh_coordinator_nats_next_seq", "Next stream sequence to apply.", "next_seq"),
    Series("kvmesh_coordinator_nats_pending", "Stream messages not applied yet.", "pending"),
    Series(
        "kvmesh_coordinator_nats_messages",
        "Stream messages by outcome.",
        "messages",
        "counter",
        label="outcome",
    ),
    Series(
        "kvmesh_coordinator_nats_commands_sent",
        "Commands published to nodes over NATS.",
        "commands_sent",
        "counter",
    ),
]


# --------------------------------------------------------------------------------------
# Source
# --------------------------------------------------------------------------------------


class _Delivery(NamedTuple):
    stream_seq: int
    subject: str
    data: bytes
    pending: int


_LOST = object()


class NatsEventSource:
    """Reads the JetStream stream of cache events into ``core`` (module docstring).

    Build it before ``core.load_state()`` (it registers its position as a
    checkpoint component), :meth:`start` it on the coordinator's event loop
    after ``core.start()``, :meth:`stop` it before ``core.stop()`` (whose
    final checkpoint then holds the final position). ``on_command_result``
    receives ``(instance_id, CommandResult)`` for every result a node
    publishes (on the loop thread; keep it quick).
    """

    def __init__(
        self,
        core: Coordinator,
        settings: NatsSourceSettings,
        *,
        on_command_result: Callable[[str, ingest_pb2.CommandResult], None] | None = None,
    ) -> None:
        self._core = core
        self.settings = settings
        self._on_command_result = on_command_result
        self.position = NatsStreamPosition(settings.stream)
        core.checkpoint_components.append(self.position)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._nc: NatsClient | None = None
        self._stopping = threading.Event()
        self._executor: ThreadPoolExecutor | None = None
        self._applying: asyncio.Future[None] | None = None
        self._seen: set[str] = set()
        self._command_ids = itertools.count(1)
        # Counters (written by the ingest thread or the loop, read anywhere).
        self._pending = 0
        self._applied = 0
        self._skipped = 0
        self._results: dict[IngestResult, int] = dict.fromkeys(IngestResult, 0)
        self._sessions = 0
        self._consumer_resets = 0
        self._commands_sent = 0
        self._command_results = 0
        self._resyncs = 0
        self._last_error = ""

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start reading (idempotent); never fails for an unreachable NATS, it retries."""
        if self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
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
        with self._lock:
            return NatsSourceStats(
                connected=self.connected,
                stream=self.settings.stream,
                next_seq=self.position.next_seq,
                pending=self._pending,
                applied=self._applied,
                skipped=self._skipped,
                admitted=self._results[IngestResult.ADMITTED],
                duplicate=self._results[IngestResult.DUPLICATE],
                stale=self._results[IngestResult.STALE_INCARNATION],
                sessions=self._sessions,
                consumer_resets=self._consumer_resets,
                commands_sent=self._commands_sent,
                command_results=self._command_results,
                resyncs_requested=self._resyncs,
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
            applied_before = self._applied
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
            if self._applied > applied_before:
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
            with self._lock:
                self._sessions += 1
            await nc.subscribe(f"{COMMAND_RESULTS_ROOT}.*", cb=self._on_result)
            js = nc.jetstream(timeout=s.connect_timeout_s)
            info = await self._wait_for_stream(js, lost)
            start = self._start_seq(info)
            await self._consume(nc, js, start, lost)
        finally:
            if self._nc is nc:
                self._nc = None
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
                chunk: list[_Delivery] = []
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
                            _Delivery(md.sequence.stream, item.subject, item.data, md.num_pending)
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

    # ------------------------------------------------------------------ applying

    async def _apply_chunk(self, chunk: Sequence[_Delivery]) -> None:
        loop = asyncio.get_running_loop()
        executor = self._executor
        if executor is None:
            raise _ConsumerLost("the source is stopping")
        future = loop.run_in_executor(executor, self._apply, chunk)
        self._applying = future
        # Shielded: cancelling the source must not abandon a chunk half-applied
        # behind stop()'s back (stop waits for it instead).
        await asyncio.shield(future)

    def _apply(self, chunk: Sequence[_Delivery]) -> None:
        """Apply deliveries in order (ingest thread); the position follows each one."""
        position = self.position
        for delivery in chunk:
            if self._stopping.is_set():
                return  # the rest is replayed from the position next time
            if delivery.stream_seq < position.next_seq:
                continue  # already applied (a recreated consumer may repeat)
            self._apply_one(delivery)
            position.advance(delivery.stream_seq + 1)
            with self._lock:
                self._pending = delivery.pending

    def _apply_one(self, delivery: _Delivery) -> None:
        try:
            batch = validated_batch_from_proto(
                events_pb2.CacheEventBatch.FromString(delivery.data), "batch"
            )
        except (DecodeError, KvmeshError, ValueError) as exc:
            self._skip(delivery, f"not a valid CacheEventBatch: {exc}")
            return
        if delivery.subject != events_subject(batch.instance_id):
            self._skip(delivery, f"batch of instance {batch.instance_id!r} on the wrong subject")
            return
        if batch.instance_id not in self._seen:
            self._first_sighting(batch)
        try:
            result = self._ingest(batch)
        except Exception as exc:
            logger.exception("ingesting batch %s from the NATS stream failed", batch.ident())
            self._skip(delivery, f"ingest failed: {type(exc).__name__}: {exc}", logged=True)
            return
        with self._lock:
            self._applied += 1
            self._results[result] += 1

    def _ingest(self, batch: CacheEventBatch) -> IngestResult:
        return traced_ingest.ingest(self._core, batch, "nats")

    def _skip(self, delivery: _Delivery, why: str, *, logged: bool = False) -> None:
        with self._lock:
            self._skipped += 1
        if not logged:
            logger.warning(
                "skipping NATS stream message seq %d on %s: %s",
                delivery.stream_seq,
                delivery.subject,
                why,
            )

    def _first_sighting(self, batch: CacheEventBatch) -> None:
        self._seen.add(batch.instance_id)
        if not self.settings.resync_unknown or batch.seq <= 1:
            return
        if batch.instance_id in self._core.cursors():
            return
        # Its earlier batches are gone from the stream: ask for its placements again.
        logger.info(
            "the NATS stream starts at seq %d of %s (earlier events expired): asking it to resync",
            batch.seq,
            batch.instance_id,
        )
        for tier in (common_pb2.TIER_L1, common_pb2.TIER_L2):
            command = ingest_pb2.NodeCommand(resync=ingest_pb2.ResyncCommand(tier=tier))
            if self.send_command(batch.instance_id, command):
                with self._lock:
                    self._resyncs += 1

    # ------------------------------------------------------------------ commands

    def send_command(self, instance_id: str, command: ingest_pb2.NodeCommand) -> bool:
        """Publish ``command`` to the node (any thread, never blocks); False when not connected.

        A missing ``command_id`` is filled in. Delivery is best effort (core
        NATS): a node that is not subscribed right now never sees it.
        """
        nc, loop = self._nc, self._loop
        if nc is None or loop is None or not nc.is_connected:
            return False
        if not command.command_id:
            command.command_id = f"nats-cmd-{next(self._command_ids)}"
        coro = _publish(nc, commands_subject(instance_id), command.SerializeToString())
        try:
            asyncio.run_coroutine_threadsafe(coro, loop)
        except RuntimeError:  # the loop is closed
            coro.close()
            return False
        with self._lock:
            self._commands_sent += 1
        return True

    def dispatch_delete(
        self,
        instance_id: str,
        tier: Tier,
        backend: str,
        keys: Sequence[ObjectKey],
        force: bool = False,
    ) -> bool:
        """The core's ``DeleteDispatcher`` over NATS: a ``DeleteKeysCommand`` to the node."""
        return self.send_command(instance_id, delete_command(tier, backend, keys, force))

    async def _on_result(self, msg: Msg) -> None:
        token = msg.subject[len(COMMAND_RESULTS_ROOT) + 1 :]
        try:
            instance_id = instance_from_token(token)
            result = ingest_pb2.CommandResult.FromString(msg.data)
        except (DecodeError, UnicodeDecodeError, ValueError):
            logger.warning("ignoring an undecodable command result on %s", msg.subject)
            return
        with self._lock:
            self._command_results += 1
        callback = self._on_command_result
        if callback is None:
            return
        try:
            callback(instance_id, result)
        except Exception:
            logger.exception("handling the result of command %s failed", result.command_id)


async def _publish(nc: NatsClient, subject: str, payload: bytes) -> None:
    try:
        await nc.publish(subject, payload)
    except Exception as exc:
        logger.warning("publishing to %s failed: %s", subject, nats_error_text(exc))


async def _close_client(nc: NatsClient) -> None:
    try:
        if not nc.is_closed:
            await nc.close()
    except Exception:
        logger.debug("closing a NATS connection failed", exc_info=True)


# --------------------------------------------------------------------------------------
# Mixed-fleet dispatcher
# --------------------------------------------------------------------------------------


class _StreamDispatcher(Protocol):
    """The gRPC side (``NodeStreams``): who has an open stream, and dispatch over it."""

    def connected(self, instance_id: str) -> bool:
        """True while ``instance_id`` has an open event stream."""
        ...

    def dispatch_delete(
        self,
        instance_id: str,
        tier: Tier,
        backend: str,
        keys: Sequence[ObjectKey],
        force: bool = False,
    ) -> bool:
        """Send a delete down the node's stream; False when it has none."""
        ...


class PreferStreamDispatcher:
    """The core's ``DeleteDispatcher`` for gRPC and NATS nodes in one fleet.

    A node with an open gRPC event stream gets the command down that stream
    (it answers there); any other node gets it over NATS. Never blocks.
    """

    def __init__(self, streams: _StreamDispatcher, nats_source: NatsEventSource) -> None:
        self._streams = streams
        self._nats = nats_source

    def dispatch_delete(
        self,
        instance_id: str,
        tier: Tier,
        backend: str,
        keys: Sequence[ObjectKey],
        force: bool = False,
    ) -> bool:
        """Down the gRPC stream when the node has one, else over NATS."""
        if self._streams.connected(instance_id) and self._streams.dispatch_delete(
            instance_id, tier, backend, keys, force
        ):
            return True
        return self._nats.dispatch_delete(instance_id, tier, backend, keys, force)
