"""Settings of ``kvmesh node`` (kept apart from the app so the CLI can load them cheaply)."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.common.config import setting
from kvmesh.gateway.config import DEFAULT_PORT, GatewaySettings
from kvmesh.storage.config import StorageConfig


@dataclass(frozen=True, kw_only=True)
class NodeConfig(StorageConfig, GatewaySettings):
    """A storage node's settings plus its gateway's; one port serves both services."""

    port: int = setting(DEFAULT_PORT, "gRPC port of both services (0 picks a free one)")

    def validate(self) -> None:
        """Raise ConfigError on unusable settings."""
        StorageConfig.validate(self)
        self.validate_gateway()
