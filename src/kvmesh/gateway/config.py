"""Settings of the gateway service."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.common.config import ConfigError, setting
from kvmesh.rpc.server import ServerSettings

DEFAULT_PORT = 8302


@dataclass(frozen=True, kw_only=True)
class GatewaySettings:
    """Request semantics of a gateway, wherever it runs (alone, or inside ``kvmesh node``)."""

    chunk_size: int = setting(256, "tokens per chunk; engines' block sizes must divide it")
    session_ttl_seconds: float = setting(
        600.0, "a request's session (and its lookup locks) expires after this much idleness"
    )
    max_tokens: int = setting(1_000_000, "largest prompt accepted, in tokens")
    max_wait_ms: int = setting(60_000, "longest server-side wait a caller may ask for")
    hash_memo_entries: int = setting(
        8192,
        "chunk hashes of recently seen prefixes kept in memory (about 1.1 KiB each) so a "
        "repeated prefix is not re-hashed; 0 turns the memo off",
    )
    engine_reap_seconds: float = setting(
        15.0,
        "an engine (or an engine's scheduler) silent this long — no call, no heartbeat — is "
        "reaped: its KV memory unmapped, its lookups' leases ended (0 = never)",
    )

    def validate_gateway(self) -> None:
        """Raise ConfigError on unusable settings."""
        if self.chunk_size < 1:
            raise ConfigError("chunk_size must be >= 1")
        if self.session_ttl_seconds <= 0:
            raise ConfigError("session_ttl_seconds must be > 0")
        if self.max_tokens < self.chunk_size:
            raise ConfigError("max_tokens must be >= chunk_size")
        if self.max_wait_ms < 0:
            raise ConfigError("max_wait_ms must be >= 0")
        if self.hash_memo_entries < 0:
            raise ConfigError("hash_memo_entries must be >= 0")
        if self.engine_reap_seconds < 0:
            raise ConfigError("engine_reap_seconds must be >= 0")


@dataclass(frozen=True, kw_only=True)
class GatewayConfig(ServerSettings, GatewaySettings):
    """A stand-alone gateway: where its storage node is, and request limits."""

    port: int = setting(DEFAULT_PORT, "gRPC port of the engine-facing API (0 picks a free one)")
    storage_target: str = setting(
        "127.0.0.1:8301",
        "address of this node's storage service (host:port, unix:path, or lane:path for "
        "its local lane)",
    )
    storage_check_seconds: float = setting(
        2.0,
        "how often the storage node is probed; while it does not answer, health reports "
        "GatewayService NOT_SERVING",
    )

    def validate(self) -> None:
        """Raise ConfigError on unusable settings."""
        self.validate_server()
        self.validate_gateway()
        if not self.storage_target:
            raise ConfigError("storage_target must not be empty")
        if self.storage_check_seconds <= 0:
            raise ConfigError("storage_check_seconds must be > 0")
