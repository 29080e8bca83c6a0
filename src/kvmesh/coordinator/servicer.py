"""The coordinator's five gRPC services: thin adapters from protobuf to the Coordinator core.

``EventIngestService.StreamEvents`` is the one with state of its own: each
storage node keeps one stream open; batches come up (singly, or in groups
once the stream's initial metadata announced them) and are acked in order,
and the coordinator's commands to that node (deletes chosen by fleet
eviction, operator deletes, resync requests) go down the same stream. The
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
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
from google.protobuf import timestamp_pb2
from opentelemetry import trace

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.coordinator.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    directory_pb2,
    directory_pb2_grpc,
    ingest_pb2,
    ingest_pb2_grpc,
    membership_pb2,
    membership_pb2_grpc,
    policy_pb2,
    policy_pb2_grpc,
)
from kvmesh.api.events.v1 import events_pb2
from kvmesh.common.convert import key_from_proto, key_to_proto, validated_batch_from_proto
from kvmesh.common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KvmeshError,
    Unavailable,
)
from kvmesh.common.events import IngestResult, Tier
from kvmesh.common.keys import (
    ObjectKey,
    validate_cache_salt,
    validate_model_name,
    validate_object_key,
)
from kvmesh.coordinator import traced_ingest
from kvmesh.coordinator.core.coordinator import Coordinator
from kvmesh.coordinator.core.types import (
    Endpoints,
    KeyInfo,
    ModuleMemoryStatus,
    QuotaStatus,
)

if TYPE_CHECKING:  # nats-py is optional; the source is built only with --nats-url
    from kvmesh.coordinator.nats_source import NatsSourceStats

logger = logging.getLogger(__name__)
_tracer = trace.get_tracer("kvmesh.coordinator")

MAX_LOOKUP_KEYS = 100_000
MAX_TOKENS = 1_000_000
MAX_PAGE_SIZE = 10_000
VERSION = "0.1.0"
#: Initial-metadata key by which StreamEvents announces that it takes batch groups.
BATCH_GROUPS_METADATA = "kvmesh-batch-groups"
#: The most batches one BatchGroup may carry (announced under BATCH_GROUPS_METADATA).
MAX_GROUP_BATCHES = 64
#: A group is ingested batch after batch on the event loop; after this much of
#: it the reader lets the loop serve other streams and lookups before going on.
_GROUP_SLICE_S = 0.002

_TIER_TO_PROTO = {Tier.L1: common_pb2.TIER_L1, Tier.L2: common_pb2.TIER_L2}


def tier_to_proto(tier: Tier) -> common_pb2.Tier.ValueType:
    """Core tier → proto enum."""
    return _TIER_TO_PROTO[tier]


def delete_command(
    tier: Tier, backend: str, keys: Sequence[ObjectKey], force: bool
) -> ingest_pb2.NodeCommand:
    """The NodeCommand that asks a node to delete ``keys`` (any transport carries it)."""
    return ingest_pb2.NodeCommand(
        delete_keys=ingest_pb2.DeleteKeysCommand(
            tier=tier_to_proto(tier),
            backend=backend,
            keys=[key_to_proto(k) for k in keys],
            force=force,
        )
    )


def tier_filter(value: int, field: str = "tier") -> Tier | None:
    """A tier filter: L1, L2, or None for TIER_ALL / unspecified."""
    if value == common_pb2.TIER_L1:
        return Tier.L1
    if value == common_pb2.TIER_L2:
        return Tier.L2
    if value in (common_pb2.TIER_ALL, common_pb2.TIER_UNSPECIFIED):
        return None
    raise InvalidArgument(f"unknown tier {value}", field=field)


def concrete_tier(value: int, field: str = "tier", *, default: Tier | None = None) -> Tier:
    """L1 or L2 (unspecified → ``default`` when given); anything else is INVALID_ARGUMENT."""
    if value == common_pb2.TIER_UNSPECIFIED and default is not None:
        return default
    tier = tier_filter(value, field)
    if tier is None:
        raise InvalidArgument(f"{field} must be TIER_L1 or TIER_L2", field=field)
    return tier


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    if seconds > 0:
        ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def _placements(info: KeyInfo, include_tokens: bool) -> directory_pb2.KeyPlacements:
    out = directory_pb2.KeyPlacements(
        key=key_to_proto(info.key),
        access_count=info.access_count,
        num_tokens=info.num_tokens or len(info.token_ids),
        placements=[
            common_pb2.Placement(
                instance_id=p.instance_id,
                incarnation=p.incarnation,
                tier=tier_to_proto(p.tier),
                backend=p.backend,
                size_bytes=p.size_bytes,
                shared=p.shared,
            )
            for p in info.placements
        ],
    )
    if info.last_access > 0:
        out.last_access.CopyFrom(_timestamp(info.last_access))
    if include_tokens and info.token_ids:
        out.token_ids.extend(info.token_ids)
    return out


def _keys(keys: directory_pb2.KeyList, field: str = "keys") -> list[ObjectKey]:
    if len(keys.keys) > MAX_LOOKUP_KEYS:
        raise InvalidArgument(
            f"at most {MAX_LOOKUP_KEYS} keys per call, got {len(keys.keys)}", field=field
        )
    out = [key_from_proto(k) for k in keys.keys]
    for i, key in enumerate(out):
        validate_object_key(key, field=f"{field}.keys[{i}]")
    return out


@dataclass(frozen=True, slots=True)
class TokenArgs:
    """A validated TokenQuery."""

    model_name: str
    world_size: int
    cache_salt: str
    token_ids: np.ndarray


def token_query(query: directory_pb2.TokenQuery, field: str = "tokens") -> TokenArgs:
    """Validate a TokenQuery (model required, at most 1 000 000 tokens)."""
    if not query.model_name:
        raise InvalidArgument("a token query needs model_name", field=f"{field}.model_name")
    # Checked here too (the core checks again) so the error names the request's field.
    validate_model_name(query.model_name, field=f"{field}.model_name")
    validate_cache_salt(query.cache_salt, field=f"{field}.cache_salt")
    if len(query.token_ids) > MAX_TOKENS:
        raise InvalidArgument(
            f"at most {MAX_TOKENS} tokens per query, got {len(query.token_ids)}",
            field=f"{field}.token_ids",
        )
    world_size = query.world_size or 1
    if world_size > 255:
        raise InvalidArgument("world_size must be <= 255", field=f"{field}.world_size")
    return TokenArgs(
        query.model_name,
        world_size,
        query.cache_salt,
        np.array(query.token_ids, dtype=np.uint32),
    )


# ----------------------------------------------------------------------------- streams


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
    """Open event streams by instance, and the core's DeleteDispatcher over them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count(1)
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

    def send(self, instance_id: str, command: ingest_pb2.NodeCommand) -> bool:
        """Queue a command on the node's stream (any thread); False when not connected."""
        with self._lock:
            stream = self._streams.get(instance_id)
        if stream is None or stream.closed:
            return False
        if not command.command_id:
            command.command_id = f"cmd-{next(self._ids)}"
        response = ingest_pb2.StreamEventsResponse(command=command)
        try:
            stream.loop.call_soon_threadsafe(stream.outbox.put_nowait, response)
        except RuntimeError:  # the loop is closed: the stream is gone
            return False
        self.commands_sent += 1
        return True

    def dispatch_delete(
        self,
        instance_id: str,
        tier: Tier,
        backend: str,
        keys: Sequence[ObjectKey],
        force: bool = False,
    ) -> bool:
        """The core's DeleteDispatcher: a DeleteKeysCommand down the node's stream."""
        return self.send(instance_id, delete_command(tier, backend, keys, force))

    def record_result(self, instance_id: str, result: ingest_pb2.CommandResult) -> None:
        with self._lock:
            self.command_results[result.command_id] = result
            while len(self.command_results) > 4096:
                self.command_results.pop(next(iter(self.command_results)))
        if result.code and result.code != "OK":
            logger.warning(
                "node %s failed command %s: %s %s",
                instance_id,
                result.command_id,
                result.code,
                result.message,
            )


_ACK = {
    IngestResult.ADMITTED: events_pb2.INGEST_RESULT_ADMITTED,
    IngestResult.DUPLICATE: events_pb2.INGEST_RESULT_DUPLICATE,
    IngestResult.STALE_INCARNATION: events_pb2.INGEST_RESULT_STALE_INCARNATION,
}


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
        result = traced_ingest.ingest(self.core, batch, "grpc")
        return ingest_pb2.BatchAck(
            incarnation=batch.incarnation, seq=batch.seq, result=_ACK[result]
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

        if instance_id not in self.core.cursors():
            # The coordinator does not know this emitter (a cold start, or a
            # node it dropped): ask for everything the node holds again.
            for tier in (common_pb2.TIER_L1, common_pb2.TIER_L2):
                self.streams.send(
                    instance_id, ingest_pb2.NodeCommand(resync=ingest_pb2.ResyncCommand(tier=tier))
                )
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
            results=[_ACK[r] for r in results],
            admitted=sum(1 for r in results if r is IngestResult.ADMITTED),
            duplicates=sum(1 for r in results if r is IngestResult.DUPLICATE),
            stale=sum(1 for r in results if r is IngestResult.STALE_INCARNATION),
        )


# --------------------------------------------------------------------------- directory


class DirectoryServicer(directory_pb2_grpc.DirectoryServiceServicer):
    """Read APIs over the directory and the gate's cursors."""

    def __init__(self, core: Coordinator) -> None:
        self.core = core

    async def Lookup(
        self, request: directory_pb2.LookupRequest, context: Any
    ) -> directory_pb2.LookupResponse:
        which = request.WhichOneof("query")
        with_tokens = request.include_token_ids
        if which == "keys":
            keys = _keys(request.keys)
            infos = self.core.lookup(keys, with_tokens=with_tokens)
            return directory_pb2.LookupResponse(
                chunks=len(keys), results=[_placements(i, with_tokens) for i in infos]
            )
        if which == "tokens":
            q = token_query(request.tokens)
            found = self.core.lookup_tokens(
                q.model_name, q.world_size, q.cache_salt, q.token_ids, with_tokens=with_tokens
            )
            return directory_pb2.LookupResponse(
                chunks=found.chunks,
                results=[_placements(i, with_tokens) for i in found.results],
                cached_prefix_chunks=found.cached_prefix_chunks,
            )
        raise InvalidArgument("set exactly one of keys or tokens", field="query")

    async def ListKeys(
        self, request: directory_pb2.ListKeysRequest, context: Any
    ) -> directory_pb2.ListKeysResponse:
        page_size = request.page_size or 1000
        if page_size > MAX_PAGE_SIZE:
            raise InvalidArgument(f"page_size must be <= {MAX_PAGE_SIZE}", field="page_size")
        page = self.core.list_keys(
            tier=tier_filter(request.tier),
            instance_id=request.instance_id,
            backend=request.backend,
            limit=page_size,
            page_token=request.page_token,
        )
        response = directory_pb2.ListKeysResponse(
            keys=[_placements(i, False) for i in page.entries],
            next_page_token=page.next_page_token,
        )
        if page.total is not None:
            response.total = page.total
        return response

    async def GetStats(
        self, request: directory_pb2.GetStatsRequest, context: Any
    ) -> directory_pb2.GetStatsResponse:
        stats = self.core.stats()
        return directory_pb2.GetStatsResponse(
            num_keys=stats.num_keys,
            num_placements=stats.num_placements,
            l1_placements=stats.l1.count,
            l1_size_bytes=stats.l1.size_bytes,
            l2_placements=stats.l2.count,
            l2_size_bytes=stats.l2.size_bytes,
            l1_keys_by_instance=dict(stats.l1_keys_by_instance),
            token_bindings=stats.token_bindings,
        )

    async def ListIngestCursors(
        self, request: directory_pb2.ListIngestCursorsRequest, context: Any
    ) -> directory_pb2.ListIngestCursorsResponse:
        cursors = self.core.cursors()
        return directory_pb2.ListIngestCursorsResponse(
            cursors=[
                directory_pb2.IngestCursor(
                    instance_id=c.instance_id,
                    incarnation=c.incarnation,
                    last_seq=c.last_seq,
                    gap_detected=c.gap_detected,
                    batches_admitted=c.batches_admitted,
                    batches_duplicate=c.batches_duplicate,
                    batches_stale=c.batches_stale,
                    last_admitted=_timestamp(c.last_admit_time),
                )
                for _, c in sorted(cursors.items())
            ]
        )


# -------------------------------------------------------------------------- membership


class MembershipServicer(membership_pb2_grpc.MembershipServiceServicer):
    """Register, heartbeat, deregister, list."""

    def __init__(self, core: Coordinator, streams: NodeStreams) -> None:
        self.core = core
        self.streams = streams

    async def RegisterInstance(
        self, request: membership_pb2.RegisterInstanceRequest, context: Any
    ) -> membership_pb2.RegisterInstanceResponse:
        if not request.instance_id.strip():
            raise InvalidArgument(
                "instance_id must not be empty (kvmesh node ids are stable, never generated)",
                field="instance_id",
            )
        if "/" in request.instance_id or len(request.instance_id) > 256:
            raise InvalidArgument("instance_id is malformed", field="instance_id")
        if request.incarnation < 0:
            raise InvalidArgument("incarnation must be >= 0", field="incarnation")
        e = request.endpoints
        registration = self.core.register_instance(
            request.instance_id,
            incarnation=request.incarnation,
            endpoints=Endpoints(e.gateway_address, e.storage_address, e.metrics_address),
            metadata=dict(request.metadata),
        )
        s = self.core.settings
        return membership_pb2.RegisterInstanceResponse(
            instance_id=registration.instance_id,
            re_registered=registration.re_registered,
            heartbeat_interval_ms=int(s.heartbeat_interval * 1000),
            instance_timeout_ms=int(s.instance_timeout * 1000),
        )

    async def Heartbeat(
        self, request: membership_pb2.HeartbeatRequest, context: Any
    ) -> membership_pb2.HeartbeatResponse:
        self.core.heartbeat(request.instance_id)
        return membership_pb2.HeartbeatResponse()

    async def DeregisterInstance(
        self, request: membership_pb2.DeregisterInstanceRequest, context: Any
    ) -> membership_pb2.DeregisterInstanceResponse:
        existed = self.core.deregister_instance(request.instance_id)
        return membership_pb2.DeregisterInstanceResponse(existed=existed)

    async def ListInstances(
        self, request: membership_pb2.ListInstancesRequest, context: Any
    ) -> membership_pb2.ListInstancesResponse:
        return membership_pb2.ListInstancesResponse(
            instances=[
                membership_pb2.Instance(
                    instance_id=i.instance_id,
                    incarnation=i.incarnation,
                    endpoints=membership_pb2.InstanceEndpoints(
                        gateway_address=i.endpoints.gateway_address,
                        storage_address=i.endpoints.storage_address,
                        metrics_address=i.endpoints.metrics_address,
                    ),
                    metadata=dict(i.metadata),
                    registered_at=_timestamp(i.registration_time),
                    heartbeat_age_seconds=i.heartbeat_age_seconds,
                    stream_connected=self.streams.connected(i.instance_id),
                )
                for i in sorted(self.core.list_instances(), key=lambda i: i.instance_id)
            ]
        )


# ------------------------------------------------------------------------------ policy


def _module(m: ModuleMemoryStatus) -> policy_pb2.ModuleUsage:
    out = policy_pb2.ModuleUsage(
        tier=tier_to_proto(m.tier),
        backend=m.backend,
        shared=m.shared,
        used_bytes=m.used_bytes,
        capacity_bytes=m.capacity_bytes,
    )
    if m.usage_ratio is not None:
        out.usage_ratio = m.usage_ratio
    return out


def _salt_quota(q: QuotaStatus) -> policy_pb2.SaltQuota:
    out = policy_pb2.SaltQuota(
        cache_salt=q.cache_salt, tier=tier_to_proto(q.tier), used_bytes=q.used_bytes
    )
    if q.limit_bytes is not None and q.quota_exists:
        out.limit_bytes = q.limit_bytes
    return out


def _l2_only(value: int, field: str = "tier") -> Tier:
    tier = concrete_tier(value, field, default=Tier.L2)
    if tier is not Tier.L2:
        raise InvalidArgument(
            "fleet quotas apply to L2 (per-node L1 quotas are set on StorageService)", field=field
        )
    return tier


class PolicyServicer(policy_pb2_grpc.PolicyServiceServicer):
    """Quotas, pins, usage, eviction and operator deletes."""

    def __init__(self, core: Coordinator) -> None:
        self.core = core

    async def SetQuota(
        self, request: policy_pb2.SetQuotaRequest, context: Any
    ) -> policy_pb2.SetQuotaResponse:
        _l2_only(request.tier)
        _check_salt(request.cache_salt)
        self.core.set_quota(request.cache_salt, request.limit_bytes)
        return policy_pb2.SetQuotaResponse(
            quota=_salt_quota(self.core.quota_status(request.cache_salt, Tier.L2))
        )

    async def GetQuota(
        self, request: policy_pb2.GetQuotaRequest, context: Any
    ) -> policy_pb2.GetQuotaResponse:
        tier = concrete_tier(request.tier, default=Tier.L2)
        _check_salt(request.cache_salt)
        return policy_pb2.GetQuotaResponse(
            quota=_salt_quota(self.core.quota_status(request.cache_salt, tier))
        )

    async def DeleteQuota(
        self, request: policy_pb2.DeleteQuotaRequest, context: Any
    ) -> policy_pb2.DeleteQuotaResponse:
        _l2_only(request.tier)
        _check_salt(request.cache_salt)
        return policy_pb2.DeleteQuotaResponse(existed=self.core.delete_quota(request.cache_salt))

    async def ListQuotas(
        self, request: policy_pb2.ListQuotasRequest, context: Any
    ) -> policy_pb2.ListQuotasResponse:
        tier = concrete_tier(request.tier, default=Tier.L2)
        listing = self.core.list_quota_status(tier)
        return policy_pb2.ListQuotasResponse(
            quotas=[_salt_quota(q) for q in listing.by_cache_salt],
            total_used_bytes=listing.total_bytes,
        )

    async def SetDefaultQuota(
        self, request: policy_pb2.SetDefaultQuotaRequest, context: Any
    ) -> policy_pb2.SetDefaultQuotaResponse:
        _l2_only(request.tier)
        limit = request.limit_bytes if request.HasField("limit_bytes") else None
        self.core.set_default_quota(limit)
        response = policy_pb2.SetDefaultQuotaResponse()
        if limit is not None:
            response.limit_bytes = limit
        return response

    async def GetDefaultQuota(
        self, request: policy_pb2.GetDefaultQuotaRequest, context: Any
    ) -> policy_pb2.GetDefaultQuotaResponse:
        _l2_only(request.tier)
        limit = self.core.get_default_quota()
        response = policy_pb2.GetDefaultQuotaResponse()
        if limit is not None:
            response.limit_bytes = limit
        return response

    def _pin_query(
        self, request: policy_pb2.PinKeysRequest | policy_pb2.UnpinKeysRequest, pin: bool
    ) -> tuple[int, int]:
        """(requested chunks, affected keys) of a pin or unpin by keys or by tokens."""
        which = request.WhichOneof("query")
        if which == "keys":
            keys = _keys(request.keys)
            affected = self.core.pin_keys(keys) if pin else self.core.unpin_keys(keys)
            return len(keys), affected
        if which == "tokens":
            q = token_query(request.tokens)
            by_tokens = self.core.pin_tokens if pin else self.core.unpin_tokens
            result = by_tokens(q.model_name, q.world_size, q.cache_salt, q.token_ids)
            return result.requested_chunks, result.affected_keys
        raise InvalidArgument("set exactly one of keys or tokens", field="query")

    async def PinKeys(
        self, request: policy_pb2.PinKeysRequest, context: Any
    ) -> policy_pb2.PinKeysResponse:
        requested, affected = self._pin_query(request, pin=True)
        return policy_pb2.PinKeysResponse(requested_chunks=requested, affected_keys=affected)

    async def UnpinKeys(
        self, request: policy_pb2.UnpinKeysRequest, context: Any
    ) -> policy_pb2.UnpinKeysResponse:
        requested, affected = self._pin_query(request, pin=False)
        return policy_pb2.UnpinKeysResponse(requested_chunks=requested, affected_keys=affected)

    async def ListPins(
        self, request: policy_pb2.ListPinsRequest, context: Any
    ) -> policy_pb2.ListPinsResponse:
        page_size = request.page_size or 1000
        if page_size > MAX_PAGE_SIZE:
            raise InvalidArgument(f"page_size must be <= {MAX_PAGE_SIZE}", field="page_size")
        page = self.core.list_pins(
            request.cache_salt or None, request.model_name or None, page_size, request.page_token
        )
        return policy_pb2.ListPinsResponse(
            pins=[
                policy_pb2.Pin(key=key_to_proto(p.key), pin_count=p.pin_count) for p in page.pins
            ],
            next_page_token=page.next_page_token,
            total=page.total,
        )

    async def GetUsage(
        self, request: policy_pb2.GetUsageRequest, context: Any
    ) -> policy_pb2.GetUsageResponse:
        fleet = self.core.fleet_usage()
        salts = []
        for tier in (Tier.L1, Tier.L2):
            for salt, used in sorted(self.core.usage_by_salt(tier).items()):
                salts.append(
                    policy_pb2.SaltUsage(cache_salt=salt, tier=tier_to_proto(tier), used_bytes=used)
                )
        return policy_pb2.GetUsageResponse(
            instances=[
                policy_pb2.InstanceUsage(
                    instance_id=i.instance_id,
                    registered=i.registered,
                    declared_capacity=i.declared_capacity,
                    modules=[_module(m) for m in i.modules],
                )
                for i in fleet.instances
            ],
            shared_modules=[_module(m) for m in fleet.shared_modules],
            salts=salts,
        )

    async def RunEviction(
        self, request: policy_pb2.RunEvictionRequest, context: Any
    ) -> policy_pb2.RunEvictionResponse:
        report = self.core.run_eviction(dry_run=request.dry_run)
        if not report.ready and not request.dry_run:
            raise FailedPrecondition(
                "the coordinator is not ready to evict yet (nodes are still reporting)",
                reason="NOT_READY",
            )
        return policy_pb2.RunEvictionResponse(
            plan=[
                policy_pb2.SaltEviction(
                    cache_salt=salt,
                    victim_keys=len(keys),
                    victim_bytes=report.plan_bytes.get(salt, 0),
                )
                for salt, keys in sorted(report.plan.items())
            ],
            dispatched_commands=sum(1 for r in report.requests if r.accepted),
        )

    async def DeleteKeys(
        self, request: policy_pb2.DeleteKeysRequest, context: Any
    ) -> policy_pb2.DeleteKeysResponse:
        tier = tier_filter(request.tier)
        which = request.WhichOneof("query")
        if which == "keys":
            result = self.core.delete_keys(
                _keys(request.keys),
                instance_id=request.instance_id,
                tier=tier,
                force=request.force,
            )
        elif which == "tokens":
            q = token_query(request.tokens)
            result = self.core.delete_tokens(
                q.model_name,
                q.world_size,
                q.cache_salt,
                q.token_ids,
                instance_id=request.instance_id,
                tier=tier,
                force=request.force,
            )
        else:
            raise InvalidArgument("set exactly one of keys or tokens", field="query")
        return policy_pb2.DeleteKeysResponse(
            requested_keys=result.requested_keys,
            dispatched_keys=result.dispatched_keys,
            pin_skipped=result.pin_skipped,
        )


def _check_salt(salt: str) -> None:
    validate_cache_salt(salt)


# ------------------------------------------------------------------------------- admin


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    """Checkpoints and status."""

    def __init__(
        self,
        core: Coordinator,
        streams: NodeStreams,
        nats_stats: Callable[[], NatsSourceStats] | None = None,
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
        if s.started_at:
            response.started_at.CopyFrom(_timestamp(s.started_at))
        if s.last_checkpoint_time:
            response.last_checkpoint.CopyFrom(_timestamp(s.last_checkpoint_time))
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
