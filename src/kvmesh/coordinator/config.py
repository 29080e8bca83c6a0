"""Settings of the coordinator service (defaults as LMCache 0.5.6's coordinator).

See docs/coordinator.md, "Settings".
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from kvmesh.common.config import (
    ConfigError,
    check_creatable,
    read_text_file,
    require_module,
    setting,
)
from kvmesh.common.errors import InvalidArgument
from kvmesh.coordinator.core.engines import EngineSpec, parse_engine_specs
from kvmesh.coordinator.core.scoring import TierWeights
from kvmesh.rpc.server import ServerSettings

DEFAULT_PORT = 8300


@dataclass(frozen=True, kw_only=True)
class CoordinatorConfig(ServerSettings):
    """What the coordinator needs: fleet chunk size, timeouts, policy and persistence."""

    port: int = setting(DEFAULT_PORT, "gRPC port (0 picks a free one)")
    chunk_size: int = setting(256, "tokens per chunk; must equal the gateways' value")
    instance_timeout_seconds: float = setting(
        30.0, "a node silent this long is dropped (L1 fenced, cursor forgotten)"
    )
    health_check_interval_seconds: float = setting(
        10.0, "how often silent nodes are looked for (0 disables the sweep)"
    )
    eviction_check_interval_seconds: float = setting(
        5.0, "how often fleet L2 quotas are enforced (0 disables the loop)"
    )
    eviction_ratio: float = setting(0.2, "fraction of a salt's keys evicted per cycle when over")
    trigger_watermark: float = setting(
        1.0, "evict when a salt's bytes reach this fraction of its quota"
    )
    heartbeat_interval_seconds: float = setting(
        5.0,
        "how often nodes are told to heartbeat; eviction also waits this long after a start "
        "so nodes can report first",
    )
    checkpoint_path: str = setting("", "checkpoint file of the fleet view ('' disables)")
    checkpoint_interval_seconds: float = setting(
        60.0, "how often to checkpoint (0 = only on a clean stop)"
    )
    metadata_path: str = setting("", "JSON file of pins and quotas ('' keeps them in memory)")
    token_binding_capacity: int = setting(
        1_000_000, "chunks whose tokens are kept for lookups that return tokens (0 = none)"
    )
    nats_url: str = setting(
        "", "NATS server whose JetStream stream nodes publish cache events to ('' = off)"
    )
    nats_stream: str = setting("KVMESH_EVENTS", "JetStream stream of cache events")
    engine_events: str = setting(
        "",
        "vLLM engines whose KV events to follow: "
        "'ID=tcp://HOST:PORT,replay=tcp://HOST:PORT,model=NAME,node=INSTANCE;ID2=...' "
        "(docs/routing.md)",
    )
    engine_events_file: str = setting(
        "", "JSON file of engines to follow: a list of EngineSpec objects ('' = none)"
    )
    enable_blend_lookup: bool = setting(
        False, "index the nodes' CacheBlend segments for BlendLookup (docs/blend.md)"
    )
    blend_probe_stride: int = setting(
        1, "probe every Nth prompt position in a BlendLookup that names no stride"
    )
    score_weights: str = setting(
        "engine=1.0,local_l1=0.8,peer_l1=0.6,l2=0.4",
        "weight of a matched token per tier in ScoreEngines",
    )
    publish_events_endpoint: str = setting(
        "", "ZMQ PUB endpoint re-publishing kvmesh's tiers as vLLM KV events ('' = off)"
    )
    publish_events_replay_endpoint: str = setting(
        "", "ZMQ ROUTER endpoint answering replay requests for those events ('' = none)"
    )
    publish_events_topic: str = setting(
        "kvmesh", "topic prefix of re-published events (topic = PREFIX@INSTANCE@MODEL)"
    )

    def validate(self) -> None:
        """Raise ConfigError on unusable settings."""
        self.validate_server()
        if self.chunk_size < 1:
            raise ConfigError("chunk_size must be >= 1")
        if self.blend_probe_stride < 1:
            raise ConfigError("blend_probe_stride must be >= 1")
        if self.instance_timeout_seconds <= 0:
            raise ConfigError("instance_timeout_seconds must be > 0")
        if not 0 < self.heartbeat_interval_seconds < self.instance_timeout_seconds:
            raise ConfigError(
                "heartbeat_interval_seconds must be > 0 and below instance_timeout_seconds"
            )
        for name in (
            "health_check_interval_seconds",
            "eviction_check_interval_seconds",
            "checkpoint_interval_seconds",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0")
        if not 0.0 <= self.eviction_ratio <= 1.0:
            raise ConfigError("eviction_ratio must be in [0, 1]")
        if not 0.0 < self.trigger_watermark <= 1.0:
            raise ConfigError("trigger_watermark must be in (0, 1]")
        if self.token_binding_capacity < 0:
            raise ConfigError("token_binding_capacity must be >= 0")
        if not self.nats_stream or any(c in self.nats_stream for c in ".*> /\\"):
            raise ConfigError("nats_stream must be a JetStream stream name (no '.', '*', '>', ' ')")
        if self.nats_url:
            require_module("nats")
        try:
            self.engine_specs()
            self.tier_weights()
        except InvalidArgument as exc:
            raise ConfigError(str(exc)) from exc
        if self.publish_events_replay_endpoint and not self.publish_events_endpoint:
            raise ConfigError("publish_events_replay_endpoint needs publish_events_endpoint")
        for name in ("checkpoint_path", "metadata_path"):
            if getattr(self, name):
                check_creatable(name, getattr(self, name))

    def engine_specs(self) -> list[EngineSpec]:
        """Engines named by ``engine_events`` and ``engine_events_file`` (InvalidArgument)."""
        specs = parse_engine_specs(self.engine_events)
        if self.engine_events_file:
            text = read_text_file(Path(self.engine_events_file), "engine_events_file")
            try:
                items = json.loads(text)
            except ValueError as exc:
                raise InvalidArgument(
                    f"engine_events_file {self.engine_events_file}: not JSON ({exc})",
                    field="engine_events_file",
                ) from exc
            if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
                raise InvalidArgument(
                    "engine_events_file must hold a JSON list of objects",
                    field="engine_events_file",
                )
            for item in items:
                try:
                    specs.append(EngineSpec(**item))
                except TypeError as exc:
                    raise InvalidArgument(
                        f"engine_events_file: {exc}", field="engine_events_file"
                    ) from exc
        ids = [s.engine_id for s in specs]
        if len(set(ids)) != len(ids):
            raise InvalidArgument("an engine id is named twice", field="engine_events")
        return specs

    def tier_weights(self) -> tuple[float, float, float, float]:
        """``score_weights`` as (engine, local_l1, peer_l1, l2)."""
        values = dataclasses.asdict(TierWeights())
        names = tuple(values)
        for part in filter(None, (p.strip() for p in self.score_weights.split(","))):
            name, _, text = part.partition("=")
            if name not in values:
                raise InvalidArgument(
                    f"score_weights: unknown tier {name!r} (known: {', '.join(names)})",
                    field="score_weights",
                )
            try:
                value = float(text)
            except ValueError:
                raise InvalidArgument(
                    f"score_weights: {part!r} is not TIER=NUMBER", field="score_weights"
                ) from None
            values[name] = value
        return dataclasses.astuple(TierWeights(**values))
