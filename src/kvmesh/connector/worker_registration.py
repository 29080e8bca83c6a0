"""The worker's KV registration: describe the engine's paged KV memory to the gateway,
and keep it registered (the heartbeat registers again whenever the gateway forgot it).

See docs/connector.md, "Worker flow".
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import grpc

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.common.dtypes import proto_of_torch
from kvmesh.connector.base import ConnectorBase
from kvmesh.connector.heartbeat import Heartbeat
from kvmesh.connector.types import (
    ConnectorError,
    KVConnectorRole,
    KVMeshConnectorConfig,
    ShmRegion,
    rpc_failure,
    status_code,
)
from kvmesh.gateway.client import GatewayClient

if TYPE_CHECKING:  # the engine hands tensors in; importing the connector loads no torch
    import torch

logger = logging.getLogger(__name__)


class WorkerRegistration(ConnectorBase):
    """Registration and liveness of one worker's KV memory."""

    def __init__(
        self,
        config: KVMeshConnectorConfig,
        role: KVConnectorRole,
        *,
        client: GatewayClient | None = None,
    ) -> None:
        super().__init__(config, role, client=client)
        self._registration: gateway_pb2.RegisterKVCacheRequest | None = None
        self._register_lock = threading.Lock()
        self._registered = False
        self._refused = ""  # why the gateway last refused the registration
        #: Successful registrations (1 + re-registrations after the gateway forgot us).
        self.registrations = 0

    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], regions: Mapping[str, ShmRegion]
    ) -> None:
        """Register the paged KV tensors (flash-attn layout, layer order) and their memory.

        ``regions[name]`` says where ``kv_caches[name]`` lives in shared memory;
        storage maps it and copies blocks directly. Raises
        :class:`ConnectorError` on unusable tensors and ``grpc.RpcError`` when
        the gateway refuses.
        """
        self._require(KVConnectorRole.WORKER)
        if not kv_caches:
            raise ConnectorError("no KV caches to register")
        if set(kv_caches) != set(regions):
            raise ConnectorError("kv_caches and regions name different layers")
        tensors = list(kv_caches.values())
        first = tensors[0]
        shape = tuple(first.shape)
        if len(shape) != 5 or shape[0] != 2:
            raise ConnectorError(
                f"expected flash-attn layers [2, num_blocks, block_size, kv_heads, head_dim], "
                f"got {shape}"
            )
        if shape[2] != self.config.block_size:
            raise ConnectorError(
                f"layers have block size {shape[2]}, configured {self.config.block_size}"
            )
        dtype = proto_of_torch(first.dtype)
        if dtype is None:
            raise ConnectorError(f"unsupported KV dtype {first.dtype}")
        handles = []
        for name, tensor in kv_caches.items():
            if tuple(tensor.shape) != shape or tensor.dtype != first.dtype:
                raise ConnectorError(f"layer {name} differs in shape or dtype from the first")
            if not tensor.is_contiguous():
                raise ConnectorError(f"layer {name} is not contiguous")
            region = regions[name]
            nbytes = tensor.numel() * tensor.element_size()
            if region.size_bytes != nbytes:
                raise ConnectorError(
                    f"layer {name}: region of {region.size_bytes} bytes for a {nbytes}-byte tensor"
                )
            handles.append(
                common_pb2.MemoryHandle(
                    shared_memory=common_pb2.SharedMemoryHandle(
                        path=region.path,
                        offset_bytes=region.offset_bytes,
                        size_bytes=region.size_bytes,
                    )
                )
            )
        layout = common_pb2.KVLayout(
            kind=common_pb2.KV_LAYOUT_KIND_FLASH_ATTN,
            num_layers=len(tensors),
            num_blocks=shape[1],
            block_size=shape[2],
            kv_heads=shape[3],
            head_dim=shape[4],
            dtype=dtype,  # type: ignore[arg-type]
        )
        self.register_memory(layout, handles)

    def register_memory(
        self, layout: common_pb2.KVLayout, handles: Sequence[common_pb2.MemoryHandle]
    ) -> None:
        """Register KV memory the caller already described (one handle per layer, in order).

        Raises ``grpc.RpcError`` when the gateway refuses (its message names the
        field) or cannot be reached. Either way the heartbeat (``heartbeat_s``)
        keeps trying: it registers again whenever the gateway does not know the
        engine (it was down at start, restarted, or reaped the engine).
        """
        self._require(KVConnectorRole.WORKER)
        self._registration = gateway_pb2.RegisterKVCacheRequest(
            engine_id=self.engine_id,
            model_name=self.config.model_name,
            world_size=self.config.world_size,
            worker_id=self.config.worker_id,
            layout=layout,
            layers=handles,
        )
        try:
            self._register()
        finally:
            self._start_heartbeat()

    @property
    def registered(self) -> bool:
        """True while the gateway holds this engine's registration (loads and stores run)."""
        return self._registered

    def _start_heartbeat(self) -> None:
        if self._heartbeat is None and self.config.heartbeat_s > 0:
            self._heartbeat = Heartbeat(
                self._beat, self.config.heartbeat_s, f"kvmesh-heartbeat-{self.engine_id}"
            )
            self._heartbeat.start()

    def _register(self) -> None:
        assert self._registration is not None
        with self._register_lock:
            resp = self.client.register_kv_cache(
                self._registration, timeout=self.config.register_timeout_s
            )
            self._check_chunk_size(resp.chunk_size)
            first = self.registrations == 0
            self.registrations += 1
            self._registered = True
            self._refused = ""  # a later refusal is said again
        (logger.info if first else logger.warning)(
            "engine %s %s with gateway %s (chunk size %d, storage %s)",
            self.engine_id,
            "registered" if first else "registered again",
            self.config.gateway,
            resp.chunk_size,
            resp.storage_instance_id or "?",
        )

    def _beat(self) -> None:
        """One heartbeat: ping, and register when the gateway does not know the engine."""
        if self._registration is None:
            return
        if self._registered:
            try:
                known = self.client.ping(
                    gateway_pb2.PingRequest(engine_id=self.engine_id), timeout=self._timeout
                ).engine_known
            except grpc.RpcError as exc:
                self._note_failure("heartbeat", exc)
                return
            self._note_ok()
            if known:
                return
            self._registered = False
            logger.warning(
                "kvmesh gateway %s no longer knows engine %s (restarted, or reaped it); "
                "registering again, requests are computed meanwhile",
                self.config.gateway,
                self.engine_id,
            )
        try:
            self._register()
        except grpc.RpcError as exc:
            if status_code(exc) != grpc.StatusCode.FAILED_PRECONDITION:
                self._note_failure("registering the KV memory", exc)
            elif rpc_failure(exc) != self._refused:  # said once, not every beat
                self._refused = rpc_failure(exc)
                logger.warning("kvmesh stays off for this engine: %s", self._refused)
        except ConnectorError as exc:
            logger.warning("registering the KV memory failed: %s", exc)

    def _forgotten(self, call: str, exc: grpc.RpcError) -> bool:
        """True (and the heartbeat registers again, off this thread) when a call failed
        because the gateway no longer knows this engine."""
        if status_code(exc) != grpc.StatusCode.FAILED_PRECONDITION:
            return False
        if self._registered:
            self._registered = False
            logger.warning(
                "%s: gateway %s does not know engine %s; registering it again in the background",
                call,
                self.config.gateway,
                self.engine_id,
            )
        if self._heartbeat is not None:
            self._heartbeat.wake()
        return True
