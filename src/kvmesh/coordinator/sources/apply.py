"""The bridge from stream messages to the core: decode, validate, ingest, move the position.

Each message is applied (decode → validate → ingest) *before* the position
moves past it, so a checkpoint never holds a position beyond what its
directory contains. A message that cannot be decoded or validated, or whose
subject does not name its batch's instance, is logged and skipped, and the
position still moves past it: one bad publisher never wedges the stream.

When the first batch seen from an instance has ``seq > 1`` and the gate
holds no cursor for it (the stream's retention already dropped its
beginning), the node is asked to resync both tiers, as the gRPC ingest
service does for an unknown node opening a stream.

:meth:`StreamApplier.apply` runs on the source's one ingest thread, a chunk
of deliveries at a time; it needs no NATS client (deliveries are plain
tuples), so it is tested and reused without one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

from google.protobuf.message import DecodeError

from kvmesh.api.coordinator.v1 import ingest_pb2
from kvmesh.api.events.v1 import events_pb2
from kvmesh.common.convert import validated_batch_from_proto
from kvmesh.common.errors import KvmeshError
from kvmesh.common.events import CacheEventBatch, IngestResult
from kvmesh.common.nats_names import events_subject
from kvmesh.coordinator.core.coordinator import Coordinator
from kvmesh.coordinator.core.tracing import ingest_traced
from kvmesh.coordinator.sources.position import NatsStreamPosition
from kvmesh.coordinator.wire import resync_commands

logger = logging.getLogger(__name__)


class Delivery(NamedTuple):
    """One stream message as the consumer received it."""

    stream_seq: int
    subject: str
    data: bytes
    pending: int
    """Messages the stream held beyond this one when it was delivered."""


class ApplyCounts(NamedTuple):
    """What the applier did so far (read together)."""

    pending: int
    applied: int
    skipped: int
    admitted: int
    duplicate: int
    stale: int
    resyncs: int


class StreamApplier:
    """Applies deliveries to ``core`` in order and advances ``position`` past each.

    ``send_command`` publishes a command to a node (for resync requests);
    ``stopping`` makes :meth:`apply` leave the rest of a chunk to be
    replayed from the position. Counters are read from any thread.
    """

    def __init__(
        self,
        core: Coordinator,
        position: NatsStreamPosition,
        stopping: threading.Event,
        send_command: Callable[[str, ingest_pb2.NodeCommand], bool],
        *,
        resync_unknown: bool = True,
    ) -> None:
        self._core = core
        self._position = position
        self._stopping = stopping
        self._send_command = send_command
        self._resync_unknown = resync_unknown
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._pending = 0
        self._applied = 0
        self._skipped = 0
        self._results: dict[IngestResult, int] = dict.fromkeys(IngestResult, 0)
        self._resyncs = 0

    @property
    def applied(self) -> int:
        """Messages applied so far."""
        with self._lock:
            return self._applied

    def counts(self) -> ApplyCounts:
        """Every counter, read together."""
        with self._lock:
            return ApplyCounts(
                pending=self._pending,
                applied=self._applied,
                skipped=self._skipped,
                admitted=self._results[IngestResult.ADMITTED],
                duplicate=self._results[IngestResult.DUPLICATE],
                stale=self._results[IngestResult.STALE_INCARNATION],
                resyncs=self._resyncs,
            )

    def apply(self, chunk: Sequence[Delivery]) -> None:
        """Apply deliveries in order (ingest thread); the position follows each one."""
        position = self._position
        for delivery in chunk:
            if self._stopping.is_set():
                return  # the rest is replayed from the position next time
            if delivery.stream_seq < position.next_seq:
                continue  # already applied (a recreated consumer may repeat)
            self._apply_one(delivery)
            position.advance(delivery.stream_seq + 1)
            with self._lock:
                self._pending = delivery.pending

    def _apply_one(self, delivery: Delivery) -> None:
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
        return ingest_traced(self._core, batch, "nats")

    def _skip(self, delivery: Delivery, why: str, *, logged: bool = False) -> None:
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
        if not self._resync_unknown or batch.seq <= 1:
            return
        if batch.instance_id in self._core.cursors():
            return
        # Its earlier batches are gone from the stream: ask for its placements again.
        logger.info(
            "the NATS stream starts at seq %d of %s (earlier events expired): asking it to resync",
            batch.seq,
            batch.instance_id,
        )
        sent = 0
        for command in resync_commands():
            if self._send_command(batch.instance_id, command):
                sent += 1
        if sent:
            with self._lock:
                self._resyncs += sent
            # The gate is about to see this batch start a fresh cursor past seq 1:
            # this request covers it (core.resync, trigger 3).
            self._core.resync.note_requested(batch.instance_id)
