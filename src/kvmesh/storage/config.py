"""Settings of the storage service (L1/L2 defaults as LMCache 0.5.6)."""

from __future__ import annotations

import json
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvmesh.common.config import ConfigError, check_creatable, require_module, setting
from kvmesh.common.thread_priority import MAX_REALTIME_PRIORITY, realtime_supported
from kvmesh.rpc.server import ServerSettings

DEFAULT_PORT = 8301
_L2_SHORTHANDS = "disk, none"
# Adapter types that need an optional package (and so an extra of kvmesh).
_L2_PACKAGES = {"redis": "redis", "s3": "boto3", "nixl": "nixl_cu12"}
_L2_EXAMPLE = '{"type": "redis", "url": "redis://127.0.0.1:6379"}'


@dataclass(frozen=True, kw_only=True)
class StorageConfig(ServerSettings):
    """What a storage node needs: identity, L1 size, L2 adapters, coordinator."""

    port: int = setting(DEFAULT_PORT, "gRPC port (0 picks a free one)")
    instance_id: str = setting(
        "", "stable node id for the coordinator ('' = storage-<hostname>-<port>)"
    )
    coordinator_target: str = setting(
        "", "coordinator address (host:port); '' runs without reporting cache events"
    )
    gateway_address: str = setting(
        "",
        "this node's gateway as the coordinator lists it (ListInstances, kvmesh status); "
        "'' = none (kvmesh node: its own address; kvmesh up sets it)",
    )
    data_dir: str = setting(
        "", "node state: incarnation counter, default disk L2 ('' = <tmp>/kvmesh/<instance_id>)"
    )
    l1_size_bytes: int = setting(2 * 1024**3, "L1 CPU memory, grown lazily up to this size")
    l1_segment_bytes: int = setting(
        0, "L1 grows by shared-memory segments this big (0 = min(256MiB, l1_size_bytes))"
    )
    l1_prefault_bytes: int = setting(
        0, "L1 mapped and pre-faulted at start, off the request path (0 = one segment)"
    )
    shm_dir: str = setting("/dev/shm", "directory of the L1 shared-memory segments")
    allowed_memory_dir: str = setting(
        "/dev/shm", "engines' KV shared-memory files must lie inside this directory"
    )
    l2: list[str] = setting(  # noqa: RUF009 - setting() makes a default_factory field
        ["disk"],
        "L2 adapters in priority order: 'disk', 'none', or JSON such as "
        '\'{"type": "redis", "url": "redis://127.0.0.1:6379"}\'',
    )
    eviction_watermark: float = setting(0.8, "evict L1 when used bytes reach this fraction")
    eviction_ratio: float = setting(0.2, "fraction of L1 bytes freed per eviction cycle")
    read_ttl_seconds: float = setting(300.0, "a read lock expires after this (crashed clients)")
    write_ttl_seconds: float = setting(600.0, "an unfinished write expires after this")
    store_policy: Literal["default", "skip_l1"] = setting(
        "default", "default keeps chunks in L1 after writing them to L2; skip_l1 drops them"
    )
    prefetch_policy: Literal["default", "retain"] = setting(
        "default", "default frees chunks loaded from L2 after use; retain keeps them in L1"
    )
    prefetch_max_in_flight: int = setting(8, "L2→L1 prefetches running at once")
    max_chunks_per_request: int = setting(4096, "largest store/retrieve/lookup, in chunks")
    copy_threads: int = setting(
        0,
        "threads copying chunks from engines into L1 (stores), and as many again copying "
        "chunks into engines (loads) (0 = one per core, 2 to 8)",
    )
    store_copy_threads: int = setting(
        1,
        "threads one store's copy uses (0 = as many as a load's copy: torch's thread "
        "count); engines wait for loads, not for stores, so by default a store leaves the "
        "other cores to the engine and to loads (docs/architecture.md)",
    )
    realtime_priority: int = setting(
        0,
        "run the event loop and the copy threads under SCHED_FIFO at this priority (1-99), "
        "so engine processes that poll without sleeping never delay a lookup or a load; "
        "needs CAP_SYS_NICE (0 = the default policy; docs/deployment.md)",
    )
    heartbeat_seconds: float = setting(5.0, "how often to heartbeat the coordinator")
    event_flush_ms: int = setting(50, "cache events are batched for at most this long")
    event_transport: Literal["grpc", "nats"] = setting(
        "grpc",
        "how cache events reach the coordinator: its gRPC stream, or a NATS JetStream stream "
        "it replays after a restart (membership still uses coordinator_target)",
    )
    nats_url: str = setting("nats://127.0.0.1:4222", "NATS server (event_transport nats)")
    nats_stream: str = setting("KVMESH_EVENTS", "JetStream stream of cache events")
    nats_max_age_seconds: float = setting(
        86400.0, "events kept this long when this node creates the stream (0 = forever)"
    )
    advertise_address: str = setting(
        "",
        "host[:port] where other nodes reach this node's storage (P2P; without a port, the "
        "bound one); '' = the bound address, required when listening on 0.0.0.0 or ::",
    )
    p2p: bool = setting(
        True,
        "on a local L1/L2 miss, fetch the prefix from a peer found in the coordinator's "
        "directory (only with coordinator_target; --no-p2p turns it off)",
    )
    p2p_lookup_timeout: float = setting(
        30.0, "seconds for the directory lookup and the peer's lock (P2P)"
    )
    p2p_load_timeout: float = setting(30.0, "seconds for streaming a prefix from a peer (P2P)")
    p2p_lease_ttl: float = setting(
        30.0, "seconds a prefix locked for a peer stays locked if the peer never reads it"
    )
    p2p_membership_refresh: float = setting(
        0.5,
        "seconds between the coordinator listings that keep this node's list of peers "
        "fresh in the background, so an idle node's miss never waits for one (P2P; "
        "below 1, the listing's lifetime; 0 = list only when a fetch needs it)",
    )
    p2p_frame_bytes: int = setting(
        1024**2, "largest frame of a P2P byte stream (1 MiB measured best; kvmesh bench p2p)"
    )
    p2p_max_in_flight: int = setting(4, "P2P fetches running at once")
    p2p_max_streams: int = setting(
        8,
        "chunk streams this node's data plane sends to peers at once (one thread each); "
        "a peer asking beyond that reads over gRPC's ReadChunks",
    )
    p2p_data_port: int = setting(
        0,
        "TCP port of the P2P data plane that sends chunk bytes to peers, on the gRPC "
        "host (0 = any free port; -1 = none: peers read over gRPC's ReadChunks)",
    )

    def validate_p2p(self) -> None:
        """Raise ConfigError on unusable P2P settings (advertise address, timeouts, sizes)."""
        if self.p2p_lookup_timeout <= 0 or self.p2p_load_timeout <= 0 or self.p2p_lease_ttl <= 0:
            raise ConfigError("p2p_lookup_timeout, p2p_load_timeout and p2p_lease_ttl must be > 0")
        if not 64 * 1024 <= self.p2p_frame_bytes <= 16 * 1024**2:
            raise ConfigError("p2p_frame_bytes must be in [64KiB, 16MiB]")
        if self.p2p_frame_bytes > self.max_message_bytes - 4096:
            raise ConfigError("p2p_frame_bytes must leave room within max_message_bytes")
        if not 0 <= self.p2p_membership_refresh < 1:
            raise ConfigError("p2p_membership_refresh must be in [0, 1) seconds")
        if self.p2p_max_in_flight < 1:
            raise ConfigError("p2p_max_in_flight must be >= 1")
        if not 1 <= self.p2p_max_streams <= 256:
            raise ConfigError("p2p_max_streams must be in [1, 256]")
        if not -1 <= self.p2p_data_port <= 65535:
            raise ConfigError("p2p_data_port must be -1 (off), 0 (any free port) or a port")
        if self.advertise_address:
            host, port = split_advertise_address(self.advertise_address)
            if (
                not host
                or (port is not None and not 0 < port < 65536)
                or host in ("0.0.0.0", "::")
                or any(c.isspace() or c in "/@" for c in host)
            ):
                raise ConfigError(
                    f"advertise_address {self.advertise_address!r} must be host[:port] that "
                    "other nodes can dial (not a wildcard address)"
                )
        elif (
            self.host in ("0.0.0.0", "::", "")
            and not self.unix_socket
            and self.coordinator_target
            and self.p2p
        ):
            raise ConfigError(
                f"listening on {self.host or 'every address'} needs --advertise-address "
                "(the host:port other nodes dial for P2P), or --no-p2p"
            )

    def segment_bytes(self) -> int:
        """The L1 segment size in effect."""
        return self.l1_segment_bytes or min(256 * 1024**2, self.l1_size_bytes)

    def resolved_instance_id(self, bound_port: int) -> str:
        """The configured id, or one derived from host name and port (never random)."""
        return self.instance_id or f"storage-{socket.gethostname()}-{bound_port}"

    def resolved_data_dir(self, instance_id: str) -> Path:
        """Where node state lives."""
        if self.data_dir:
            return Path(self.data_dir).expanduser()
        return Path(tempfile.gettempdir()) / "kvmesh" / instance_id

    def l2_configs(self, data_dir: Path) -> list[dict[str, object]]:
        """Adapter configs, with the 'disk' shorthand expanded under data_dir.

        Each JSON config is checked against its adapter's schema here, so a
        bad one is a one-line ConfigError at start, before anything is built.
        """
        from kvmesh.common.errors import InvalidArgument
        from kvmesh.storage.core.l2.factory import parse_l2_config

        configs: list[dict[str, object]] = []
        for i, item in enumerate(self.l2):
            text = item.strip()
            if text in ("", "none"):
                continue
            if text == "disk":
                configs.append({"type": "disk", "base_path": str(data_dir / "l2")})
                continue
            try:
                parsed = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"l2: {item!r} is neither a shorthand ({_L2_SHORTHANDS}) nor JSON such as "
                    f"{_L2_EXAMPLE}"
                ) from exc
            try:
                parse_l2_config(parsed, path=f"l2[{i}]")
            except InvalidArgument as exc:
                about_kind = exc.field in (f"l2[{i}]", f"l2[{i}].type")
                hint = f"; or a shorthand: {_L2_SHORTHANDS}" if about_kind else ""
                raise ConfigError(f"{exc.message}{hint}") from exc
            if parsed["type"] in _L2_PACKAGES:
                require_module(_L2_PACKAGES[parsed["type"]])
            configs.append(parsed)
        return configs

    def validate(self) -> None:
        """Raise ConfigError on unusable settings."""
        self.validate_server()
        # L1 and the engine memory it copies to are torch tensors (the "storage" extra).
        require_module("torch")
        if self.l1_size_bytes < 1024**2:
            raise ConfigError("l1_size_bytes must be at least 1MiB")
        if self.l1_segment_bytes and not 4096 <= self.l1_segment_bytes <= self.l1_size_bytes:
            raise ConfigError("l1_segment_bytes must be 0 (auto) or in [4KiB, l1_size_bytes]")
        if not 0 <= self.l1_prefault_bytes <= self.l1_size_bytes:
            raise ConfigError("l1_prefault_bytes must be in [0, l1_size_bytes]")
        if not 0.0 < self.eviction_watermark <= 1.0:
            raise ConfigError("eviction_watermark must be in (0, 1]")
        if not 0.0 < self.eviction_ratio <= 1.0:
            raise ConfigError("eviction_ratio must be in (0, 1]")
        if self.read_ttl_seconds <= 0 or self.write_ttl_seconds <= 0:
            raise ConfigError("lock TTLs must be > 0")
        if self.prefetch_max_in_flight < 1:
            raise ConfigError("prefetch_max_in_flight must be >= 1")
        if self.max_chunks_per_request < 1:
            raise ConfigError("max_chunks_per_request must be >= 1")
        if self.copy_threads < 0:
            raise ConfigError("copy_threads must be >= 0 (0 = one per core, 2 to 8)")
        if self.store_copy_threads < 0:
            raise ConfigError("store_copy_threads must be >= 0 (0 = as many as a load's copy)")
        if not 0 <= self.realtime_priority <= MAX_REALTIME_PRIORITY:
            raise ConfigError(
                f"realtime_priority must be 0 (off) or 1..{MAX_REALTIME_PRIORITY} (SCHED_FIFO)"
            )
        if self.realtime_priority and not realtime_supported():
            raise ConfigError("realtime_priority needs Linux's SCHED_FIFO; set it to 0 here")
        if self.heartbeat_seconds <= 0 or self.event_flush_ms < 1:
            raise ConfigError("heartbeat_seconds and event_flush_ms must be > 0")
        if self.event_transport == "nats":
            if not self.nats_url:
                raise ConfigError("nats_url must be set when event_transport is nats")
            if not self.nats_stream or any(c in self.nats_stream for c in ".*> /\\"):
                raise ConfigError("nats_stream must be a JetStream stream name")
            if self.nats_max_age_seconds < 0:
                raise ConfigError("nats_max_age_seconds must be >= 0")
            require_module("nats")
        self.validate_p2p()
        if "/" in self.instance_id or "@" in self.instance_id:
            raise ConfigError("instance_id must not contain '/' or '@'")
        self.l2_configs(Path("."))
        check_creatable("shm_dir", self.shm_dir, directory=True)
        if self.data_dir:
            check_creatable("data_dir", self.data_dir, directory=True)


def split_advertise_address(address: str) -> tuple[str, int | None]:
    """``(host, port)`` of ``host[:port]`` (``[v6]:port`` too); port None when absent or bad."""
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif address.count(":") == 1:
        host, _, port_text = address.partition(":")
    else:
        host, port_text = address, ""
    if not port_text:
        return host, None
    return host, int(port_text) if port_text.isdigit() else -1
