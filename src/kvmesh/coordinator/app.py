"""The coordinator as a service: core, six servicers, node streams, engine events, metrics.

The top of the coordinator's layers: core ← wire ← servicers / sources ← app.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client.registry import Collector

from kvmesh.api.coordinator.v1 import (
    admin_pb2_grpc,
    directory_pb2_grpc,
    engines_pb2_grpc,
    ingest_pb2_grpc,
    membership_pb2_grpc,
    policy_pb2_grpc,
)
from kvmesh.common.events import Tier
from kvmesh.coordinator.config import CoordinatorConfig
from kvmesh.coordinator.core.coordinator import Coordinator
from kvmesh.coordinator.core.settings import CoordinatorSettings
from kvmesh.coordinator.enginefeed.publisher import TierPublisher
from kvmesh.coordinator.enginefeed.subscriber import EngineFeed
from kvmesh.coordinator.servicers.admin import AdminServicer
from kvmesh.coordinator.servicers.directory import DirectoryServicer
from kvmesh.coordinator.servicers.engines import EngineServicer
from kvmesh.coordinator.servicers.ingest import EventIngestServicer, NodeStreams
from kvmesh.coordinator.servicers.membership import MembershipServicer
from kvmesh.coordinator.servicers.policy import PolicyServicer
from kvmesh.coordinator.sources.dispatch import PreferStreamDispatcher
from kvmesh.coordinator.sources.settings import NATS_SERIES, NatsSourceSettings
from kvmesh.rpc.metrics import Series, StatsCollector
from kvmesh.rpc.server import ServiceBinding

if TYPE_CHECKING:  # nats-py is optional: the source is imported only with --nats-url
    from kvmesh.coordinator.sources.jetstream import NatsEventSource

logger = logging.getLogger(__name__)

PACKAGE = "kvmesh.coordinator.v1"


def settings_from_config(config: CoordinatorConfig) -> CoordinatorSettings:
    """Map the service's config onto the core's settings."""
    return CoordinatorSettings(
        instance_timeout=config.instance_timeout_seconds,
        health_check_interval=config.health_check_interval_seconds,
        heartbeat_interval=config.heartbeat_interval_seconds,
        eviction_check_interval=config.eviction_check_interval_seconds,
        eviction_ratio=config.eviction_ratio,
        trigger_watermark=config.trigger_watermark,
        chunk_size=config.chunk_size,
        token_binding_cap=config.token_binding_capacity,
        checkpoint_path=config.checkpoint_path,
        checkpoint_interval=config.checkpoint_interval_seconds,
        metadata_path=config.metadata_path,
        score_weights=config.tier_weights(),
        enable_blend_lookup=config.enable_blend_lookup,
        blend_probe_stride=config.blend_probe_stride,
    )


def _stats(core: Coordinator, streams: NodeStreams) -> dict[str, Any]:
    status = core.status()
    d = status.directory
    cursors = status.cursors
    return {
        "keys": d.num_keys,
        "placements": {"l1": d.l1.count, "l2": d.l2.count},
        "placement_bytes": {"l1": d.l1.size_bytes, "l2": d.l2.size_bytes},
        "token_bindings": d.token_bindings,
        "fence_backlog_keys": d.fence_backlog_keys,
        "instances": status.instances,
        "streams": streams.count(),
        "ready": 1 if status.eviction_ready else 0,
        "ingest": {
            "admitted": status.batches_admitted,
            "duplicate": status.batches_duplicate,
            "stale": status.batches_stale,
        },
        "gap": {i: 1 if c.gap_detected else 0 for i, c in cursors.items()},
        "last_seq": {i: c.last_seq for i, c in cursors.items()},
        "evictions_in_flight": status.evictions_in_flight,
        "commands_sent": streams.commands_sent,
        "command_results": core.commands.result_counts(),
        "commands_awaiting": core.commands.awaiting(),
        "resyncs_requested": core.resync.stats().requested,
        "salt_l2_bytes": core.usage_by_salt(Tier.L2),
        "salt_l1_bytes": core.usage_by_salt(Tier.L1),
        "consumer_failures": {
            name: c.consume_failures + c.fence_failures for name, c in status.consumers.items()
        },
    }


_SERIES = [
    Series("kvmesh_coordinator_keys", "Keys in the directory.", "keys"),
    Series("kvmesh_coordinator_placements", "Placements by tier.", "placements", label="tier"),
    Series(
        "kvmesh_coordinator_placement_bytes",
        "Placement bytes by tier.",
        "placement_bytes",
        label="tier",
    ),
    Series("kvmesh_coordinator_token_bindings", "Chunks whose tokens are kept.", "token_bindings"),
    Series(
        "kvmesh_coordinator_fence_backlog_keys",
        "Keys of fences not yet swept.",
        "fence_backlog_keys",
    ),
    Series("kvmesh_coordinator_instances", "Registered storage nodes.", "instances"),
    Series("kvmesh_coordinator_streams", "Open node event streams.", "streams"),
    Series("kvmesh_coordinator_ready", "1 once eviction may run.", "ready"),
    Series(
        "kvmesh_coordinator_ingest_batches",
        "Batches by gate verdict.",
        "ingest",
        "counter",
        label="result",
    ),
    Series(
        "kvmesh_coordinator_gap_detected",
        "1 when an emitter's stream had a gap.",
        "gap",
        label="instance_id",
    ),
    Series(
        "kvmesh_coordinator_last_seq",
        "Last admitted seq per emitter.",
        "last_seq",
        label="instance_id",
    ),
    Series(
        "kvmesh_coordinator_evictions_in_flight",
        "Victim keys sent, not yet deleted.",
        "evictions_in_flight",
    ),
    Series(
        "kvmesh_coordinator_commands_sent",
        "Commands sent down node streams.",
        "commands_sent",
        "counter",
    ),
    Series(
        "kvmesh_coordinator_command_results",
        "Nodes' answers to coordinator commands, by command and result code.",
        "command_results",
        "counter",
        labels=("command", "result"),
    ),
    Series(
        "kvmesh_coordinator_commands_awaiting",
        "Commands sent in the last 5 minutes whose answer has not come.",
        "commands_awaiting",
    ),
    Series(
        "kvmesh_coordinator_resyncs_requested",
        "Resyncs asked of nodes.",
        "resyncs_requested",
        "counter",
    ),
    Series(
        "kvmesh_coordinator_salt_l2_bytes",
        "L2 bytes per cache salt.",
        "salt_l2_bytes",
        label="cache_salt",
    ),
    Series(
        "kvmesh_coordinator_salt_l1_bytes",
        "L1 bytes per cache salt.",
        "salt_l1_bytes",
        label="cache_salt",
    ),
    Series(
        "kvmesh_coordinator_consumer_failures",
        "Consumer exceptions (isolated).",
        "consumer_failures",
        "counter",
        label="consumer",
    ),
]


class CoordinatorApp:
    """ServiceApp of the coordinator."""

    name = "coordinator"

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.core = Coordinator(settings_from_config(config))
        # Every command sent and every answer, whichever transport, goes to the core's ledger.
        self.streams = NodeStreams(self.core.commands)
        self.core.set_delete_dispatcher(self.streams)
        self.nats: NatsEventSource | None = None
        if config.nats_url:
            # nats-py is an optional dependency (the "nats" extra).
            from kvmesh.coordinator.sources.jetstream import NatsEventSource

            # Built before load_state: it registers its stream position as a checkpoint section.
            self.nats = NatsEventSource(
                self.core,
                NatsSourceSettings(url=config.nats_url, stream=config.nats_stream),
                on_command_result=self.streams.record_result,
                on_command_sent=self.streams.record_sent,
            )
            self.core.set_delete_dispatcher(PreferStreamDispatcher(self.streams, self.nats))
        # vLLM engines' own KV events in (docs/routing.md) ...
        for spec in config.engine_specs():
            self.core.engines.register(spec)
        self.feed = EngineFeed(self.core.engines)
        # ... and kvmesh's tiers out as vLLM events.
        self.publisher: TierPublisher | None = None
        if config.publish_events_endpoint:
            self.publisher = TierPublisher(
                config.publish_events_endpoint,
                replay_endpoint=config.publish_events_replay_endpoint,
                topic_prefix=config.publish_events_topic,
                chunk_size=config.chunk_size,
            )
            # Bound now, so an endpoint that cannot be used fails before anything serves.
            self.publisher.bind()
            self.core.broadcaster.register(self.publisher)
        report = self.core.load_state()
        if report is not None and not report.cold:
            logger.info("restored checkpoint sections: %s", ", ".join(report.restored))

    def bindings(self) -> Sequence[ServiceBinding]:
        core, streams = self.core, self.streams
        ingest = EventIngestServicer(core, streams)
        directory = DirectoryServicer(core)
        membership = MembershipServicer(core, streams)
        policy = PolicyServicer(core)
        engines = EngineServicer(core)
        admin = AdminServicer(core, streams, self.nats.stats if self.nats is not None else None)

        def add(fn: Any, servicer: Any) -> Any:
            def adder(server: grpc.aio.Server) -> None:
                fn(servicer, server)

            return adder

        return [
            ServiceBinding(
                f"{PACKAGE}.EventIngestService",
                add(ingest_pb2_grpc.add_EventIngestServiceServicer_to_server, ingest),
            ),
            ServiceBinding(
                f"{PACKAGE}.DirectoryService",
                add(directory_pb2_grpc.add_DirectoryServiceServicer_to_server, directory),
            ),
            ServiceBinding(
                f"{PACKAGE}.EngineService",
                add(engines_pb2_grpc.add_EngineServiceServicer_to_server, engines),
            ),
            ServiceBinding(
                f"{PACKAGE}.MembershipService",
                add(membership_pb2_grpc.add_MembershipServiceServicer_to_server, membership),
            ),
            ServiceBinding(
                f"{PACKAGE}.PolicyService",
                add(policy_pb2_grpc.add_PolicyServiceServicer_to_server, policy),
            ),
            ServiceBinding(
                f"{PACKAGE}.AdminService",
                add(admin_pb2_grpc.add_AdminServiceServicer_to_server, admin),
            ),
        ]

    def collectors(self) -> Sequence[Collector]:
        collectors: list[Collector] = [
            StatsCollector(lambda: _stats(self.core, self.streams), _SERIES)
        ]
        if self.nats is not None:
            collectors.append(StatsCollector(self.nats.metrics, NATS_SERIES))
        return collectors

    async def start(self) -> None:
        self.core.start()
        if self.publisher is not None:
            self.publisher.start()
        await self.feed.start()
        if self.nats is not None:
            await self.nats.start()

    async def stop(self) -> None:
        await self.feed.stop()
        if self.publisher is not None:
            self.publisher.stop()
        if self.nats is not None:
            # Before the core's final checkpoint, so it holds the final stream position.
            await self.nats.stop()
        # Joins the timers and writes the final checkpoint (blocking I/O: off the loop).
        await asyncio.to_thread(self.core.stop)
