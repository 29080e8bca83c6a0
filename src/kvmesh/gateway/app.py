"""The gateway as a service: core + servicer + storage link + background sweeps.

Health tells the truth about the storage link: a stand-alone gateway probes
its storage node (a cheap ListQuotas) every ``storage_check_seconds`` and
reports ``NOT_SERVING`` for GatewayService (and so for the whole server)
while the node cannot be reached, logging the change once each way, so a
probe never routes engines to a gateway that can only answer misses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

import grpc
from prometheus_client.registry import Collector

from kvmesh.api.gateway.v1 import gateway_pb2_grpc
from kvmesh.api.storage.v1 import storage_pb2
from kvmesh.gateway.config import GatewayConfig, GatewaySettings
from kvmesh.gateway.core import Gateway, NodeStorage
from kvmesh.gateway.link import GrpcNodeStorage
from kvmesh.gateway.servicer import GatewayServicer
from kvmesh.rpc.metrics import Series, StatsCollector
from kvmesh.rpc.server import ServiceBinding
from kvmesh.storage.client import StorageClient

logger = logging.getLogger(__name__)

SERVICE_NAME = "kvmesh.gateway.v1.GatewayService"

_SERIES = [
    Series("kvmesh_gateway_lookups", "Lookups handled.", "lookups", "counter"),
    Series(
        "kvmesh_gateway_hash_memo_hits",
        "Prompt chunks whose hash came from the memo of recent prefixes.",
        "hash_memo_hits",
        "counter",
    ),
    Series(
        "kvmesh_gateway_hash_memo_misses",
        "Prompt chunks hashed with blake3 (not in the memo).",
        "hash_memo_misses",
        "counter",
    ),
    Series(
        "kvmesh_gateway_lookup_requested_tokens",
        "Tokens (complete chunks) asked about by lookups.",
        "lookup_requested_tokens",
        "counter",
    ),
    Series(
        "kvmesh_gateway_lookup_hit_tokens",
        "Tokens of lookups served from the cache.",
        "lookup_hit_tokens",
        "counter",
    ),
    Series(
        "kvmesh_gateway_lookup_l1_hit_chunks",
        "Hit chunks found in L1.",
        "lookup_l1_hit_chunks",
        "counter",
    ),
    Series(
        "kvmesh_gateway_lookup_l2_hit_chunks",
        "Hit chunks loaded from L2.",
        "lookup_l2_hit_chunks",
        "counter",
    ),
    Series(
        "kvmesh_gateway_lookups_without_engine",
        "Lookups that missed because no engine of that model is registered.",
        "lookups_without_engine",
        "counter",
    ),
    Series("kvmesh_gateway_stores", "Store calls.", "stores", "counter"),
    Series("kvmesh_gateway_stored_chunks", "Chunks stored into L1.", "stored_chunks", "counter"),
    Series(
        "kvmesh_gateway_store_skipped_chunks",
        "Chunks not stored (L1 full).",
        "store_skipped_chunks",
        "counter",
    ),
    Series("kvmesh_gateway_retrieves", "Retrieve calls.", "retrieves", "counter"),
    Series(
        "kvmesh_gateway_retrieved_chunks",
        "Chunks copied into engines.",
        "retrieved_chunks",
        "counter",
    ),
    Series(
        "kvmesh_gateway_retrieve_missed_chunks",
        "Chunks asked for by a retrieve that were no longer cached.",
        "retrieve_missed_chunks",
        "counter",
    ),
    Series(
        "kvmesh_gateway_retrieves_ahead",
        "Loads a scheduler started ahead of its worker's Retrieve (RetrieveAhead).",
        "retrieves_ahead",
        "counter",
    ),
    Series(
        "kvmesh_gateway_retrieves_joined",
        "Worker Retrieves that waited for a load started ahead instead of copying.",
        "retrieves_joined",
        "counter",
    ),
    Series(
        "kvmesh_gateway_retrieves_ahead_refused",
        "RetrieveAhead calls that started nothing: the worker had asked, or it was running.",
        "retrieves_ahead_refused",
        "counter",
    ),
    Series(
        "kvmesh_gateway_segment_stores",
        "CacheBlend segments given a slot to be stored into.",
        "segment_stores",
        "counter",
    ),
    Series(
        "kvmesh_gateway_segment_hits",
        "CacheBlend segments found resident by a retrieve.",
        "segment_hits",
        "counter",
    ),
    Series(
        "kvmesh_gateway_segment_misses",
        "CacheBlend segments asked for that were not resident.",
        "segment_misses",
        "counter",
    ),
    Series(
        "kvmesh_gateway_prefetch_waits",
        "Calls that waited for a running prefetch (L2 loads) to finish.",
        "prefetch_waits",
        "counter",
    ),
    Series(
        "kvmesh_gateway_prefetch_wait_seconds",
        "Time engines spent waiting for prefetches.",
        "prefetch_wait_seconds",
        "counter",
    ),
    Series(
        "kvmesh_gateway_sessions_expired",
        "Sessions expired by idleness.",
        "sessions_expired",
        "counter",
    ),
    Series(
        "kvmesh_gateway_lock_releases", "Lookup read locks released.", "locks_released", "counter"
    ),
    Series("kvmesh_gateway_active_sessions", "Open request sessions.", "active_sessions"),
    Series("kvmesh_gateway_registered_engines", "Registered engine workers.", "registered_engines"),
    Series(
        "kvmesh_gateway_live_owners",
        "Engine instances (schedulers) whose lookups or heartbeats arrived within the reap time.",
        "live_owners",
    ),
    Series(
        "kvmesh_gateway_engines_reaped",
        "Engine workers reaped after going silent (their KV memory unmapped).",
        "engines_reaped",
        "counter",
    ),
    Series(
        "kvmesh_gateway_owners_reaped",
        "Engine instances reaped after going silent (their sessions and leases ended).",
        "owners_reaped",
        "counter",
    ),
    Series(
        "kvmesh_gateway_reregistrations",
        "Registrations of an engine this gateway had reaped or unregistered before.",
        "reregistrations",
        "counter",
    ),
]


class GatewayApp:
    """ServiceApp of the gateway."""

    name = "gateway"

    def __init__(self, config: GatewaySettings, storage: NodeStorage | None = None) -> None:
        """A gateway over ``storage``, or, by default, over gRPC to ``config.storage_target``."""
        self.config = config
        self.storage_client: StorageClient | None = None
        if storage is None:
            if not isinstance(config, GatewayConfig):
                raise TypeError("a gateway without a storage link needs a GatewayConfig")
            self.storage_client = StorageClient(
                config.storage_target, max_message_bytes=config.max_message_bytes
            )
            storage = GrpcNodeStorage(self.storage_client)
        self.core = Gateway(
            storage,
            chunk_size=config.chunk_size,
            session_ttl_s=config.session_ttl_seconds,
            max_tokens=config.max_tokens,
            max_wait_ms=config.max_wait_ms,
            engine_reap_s=config.engine_reap_seconds,
            hash_memo_entries=config.hash_memo_entries,
        )
        self._sweeper: asyncio.Task[None] | None = None
        self._prober: asyncio.Task[None] | None = None
        self._report: Callable[[str, bool], None] | None = None
        #: Whether the storage node answered the latest probe (None: not probed yet).
        self.storage_reachable: bool | None = None

    def bindings(self) -> Sequence[ServiceBinding]:
        servicer = GatewayServicer(self.core)

        def add(server: grpc.aio.Server) -> None:
            gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, server)

        return [ServiceBinding(SERVICE_NAME, add)]

    def collectors(self) -> Sequence[Collector]:
        return [StatsCollector(self.core.stats, _SERIES)]

    async def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="gateway-sweeper")
        if self.storage_client is not None:
            await self.check_storage()
            self._prober = asyncio.create_task(self._probe_loop(), name="gateway-storage-probe")

    def watch_health(self, report: Callable[[str, bool], None]) -> None:
        """Called by the server once: ``report(service, serving)`` on every change."""
        self._report = report
        if self.storage_reachable is False:
            report(SERVICE_NAME, False)

    async def check_storage(self) -> bool:
        """Probe the storage node once; log and report a change. Returns reachability."""
        assert self.storage_client is not None
        assert isinstance(self.config, GatewayConfig)
        timeout = max(0.5, min(self.config.storage_check_seconds, 5.0))
        error = ""
        try:
            await self.storage_client.list_quotas(storage_pb2.ListQuotasRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code() if callable(getattr(exc, "code", None)) else None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                details = exc.details() if callable(getattr(exc, "details", None)) else ""
                error = str(details or code)
        reachable = not error
        if reachable != self.storage_reachable:
            if reachable:
                if self.storage_reachable is not None:
                    logger.info(
                        "storage node at %s is reachable again; GatewayService is SERVING",
                        self.config.storage_target,
                    )
            else:
                logger.warning(
                    "storage node at %s is unreachable (%s); GatewayService reports NOT_SERVING "
                    "until it answers",
                    self.config.storage_target,
                    error,
                )
            self.storage_reachable = reachable
            if self._report is not None:
                self._report(SERVICE_NAME, reachable)
        return reachable

    async def _probe_loop(self) -> None:
        assert isinstance(self.config, GatewayConfig)
        while True:
            await asyncio.sleep(self.config.storage_check_seconds)
            try:
                await self.check_storage()
            except Exception:
                logger.exception("probing the storage node failed")

    async def _sweep_loop(self) -> None:
        periods = [self.config.session_ttl_seconds / 4, 5.0]
        if self.config.engine_reap_seconds > 0:
            periods.append(self.config.engine_reap_seconds / 4)
        period = max(0.05, min(periods))
        while True:
            await asyncio.sleep(period)
            try:
                await self.core.sweep()
            except Exception:
                logger.exception("session sweep failed")

    async def stop(self) -> None:
        for task in (self._prober, self._sweeper):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.core.close()
        if self.storage_client is not None:
            await self.storage_client.close()
