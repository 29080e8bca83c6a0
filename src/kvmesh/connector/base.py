"""The part of the connector both roles run: the gateway client, chunk size and liveness."""

from __future__ import annotations

import logging
import time
import uuid

import grpc

from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.connector.heartbeat import Heartbeat
from kvmesh.connector.metadata import RetrieveOp, StoreOp
from kvmesh.connector.types import (
    ConnectorError,
    KVConnectorRole,
    KVMeshConnectorConfig,
    rpc_failure,
    status_code,
)
from kvmesh.gateway.client import GatewayClient

logger = logging.getLogger(__name__)


class ConnectorBase:
    """Settings, the typed gateway client and the gateway's chunk size."""

    def __init__(
        self,
        config: KVMeshConnectorConfig,
        role: KVConnectorRole,
        *,
        client: GatewayClient | None = None,
    ) -> None:
        if config.block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.config = config
        self.role = role
        self.engine_id = config.engine_id or f"engine-{uuid.uuid4().hex[:16]}"
        self._owns_client = client is None
        # No retries inside a call: an engine never waits on kvmesh, and an unreachable
        # gateway is handled by the back-off below (one failed try, then skipped calls).
        self.client = client or GatewayClient(config.gateway, unavailable_retries=0)
        self._timeout = config.rpc_timeout_s
        self._chunk_size: int | None = None
        # Back-off after the gateway could not be reached (see gateway_down).
        self._backoff_s = 0.0
        self._retry_at = 0.0
        # The role's heartbeat thread (started by the role's hooks; see heartbeat).
        self._heartbeat: Heartbeat | None = None

    #: Longest pause between two tries of an unreachable gateway.
    MAX_BACKOFF_S = 30.0

    def gateway_down(self) -> bool:
        """True while backing off from an unreachable gateway: calls are skipped, not tried.

        An engine never waits on kvmesh: without the back-off, a hung gateway
        would cost every new request one full RPC deadline.
        """
        return time.monotonic() < self._retry_at

    def _note_ok(self) -> None:
        """A call went through: calls are made again at once (the heartbeat is the probe)."""
        if self._backoff_s:
            logger.warning("kvmesh gateway %s answers again", self.config.gateway)
        self._backoff_s = 0.0
        self._retry_at = 0.0

    def _note_failure(self, what: str, exc: grpc.RpcError) -> None:
        """Log a failed call; an unreachable gateway starts (or doubles) the back-off."""
        if status_code(exc) not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            logger.warning("%s failed: %s", what, rpc_failure(exc))
            return
        first = self._backoff_s == 0.0
        self._backoff_s = min(max(2 * self._backoff_s, 1.0), self.MAX_BACKOFF_S)
        self._retry_at = time.monotonic() + self._backoff_s
        log = logger.warning if first else logger.debug
        log(
            "kvmesh gateway %s unreachable (%s: %s); requests are computed without kvmesh, "
            "next try in %.0f s",
            self.config.gateway,
            what,
            rpc_failure(exc),
            self._backoff_s,
        )

    def _prompt_range(
        self, op: RetrieveOp | StoreOp, *, with_tokens: bool = True
    ) -> gateway_pb2.PromptRange:
        """The op's range; ``with_tokens=False`` leaves the tokens to the gateway's session
        (an earlier call for the request sent them)."""
        return gateway_pb2.PromptRange(
            request_id=op.request_id,
            model_name=self.config.model_name,
            world_size=self.config.world_size,
            cache_salt=op.cache_salt,
            token_ids=op.token_ids if with_tokens else (),
            start_token=op.start,
            end_token=op.end,
        )

    def _retrieve_request(
        self,
        engine_id: str,
        op: RetrieveOp,
        *,
        producer_event: bytes = b"",
        with_tokens: bool = True,
    ) -> gateway_pb2.RetrieveRequest:
        """The Retrieve of ``op`` into ``engine_id``'s blocks. The scheduler's RetrieveAhead
        and the worker's Retrieve are built here alike: the gateway joins them by their
        fields (see :mod:`kvmesh.connector.ahead`)."""
        return gateway_pb2.RetrieveRequest(
            engine_id=engine_id,
            range=self._prompt_range(op, with_tokens=with_tokens),
            block_ids=op.block_ids,
            skip_first_n_tokens=op.skip_first_n_tokens,
            producer_event_handle=producer_event,
        )

    def _require(self, role: KVConnectorRole) -> None:
        if self.role is not role:
            raise RuntimeError(f"{role.value}-side hook called on a {self.role.value} connector")

    @property
    def chunk_size(self) -> int:
        """The gateway's chunk size (asked once; raises ``grpc.RpcError`` if unreachable).

        While backing off from an unreachable gateway it raises
        :class:`ConnectorError` without a call.
        """
        if self._chunk_size is None:
            if self.gateway_down():
                raise ConnectorError(f"kvmesh gateway {self.config.gateway} is unreachable")
            try:
                resp = self.client.get_chunk_size(
                    gateway_pb2.GetChunkSizeRequest(), timeout=self._timeout
                )
            except grpc.RpcError as exc:
                self._note_failure("asking the chunk size", exc)
                raise
            self._note_ok()
            self._check_chunk_size(resp.chunk_size)
        assert self._chunk_size is not None
        return self._chunk_size

    def _check_chunk_size(self, chunk_size: int) -> None:
        if chunk_size < 1 or chunk_size % self.config.block_size:
            raise ConnectorError(
                f"the gateway's chunk size {chunk_size} is not a multiple of the engine's "
                f"block size {self.config.block_size}"
            )
        self._chunk_size = chunk_size

    def ping(self) -> bool:
        """Liveness of the gateway (the worker also refreshes its engine's last-seen time)."""
        engine_id = self.engine_id if self.role is KVConnectorRole.WORKER else ""
        try:
            self.client.ping(gateway_pb2.PingRequest(engine_id=engine_id), timeout=self._timeout)
        except grpc.RpcError as exc:
            logger.warning("gateway %s: ping failed: %s", self.config.gateway, rpc_failure(exc))
            return False
        return True
