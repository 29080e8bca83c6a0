"""Worker half of the connector: KV registration, retrieves and stores (reference §6.4)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import grpc

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.common.dtypes import proto_of_torch
from kvmesh.connector.base import ConnectorBase
from kvmesh.connector.metadata import ConnectorMetadata, RetrieveOp, StoreOp
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

_Resp = TypeVar("_Resp")


@dataclass
class _Transfer:
    """One retrieve or store the worker started."""

    request_id: str
    future: Future[list[int]]


class WorkerHooks(ConnectorBase):
    """The worker-side hooks (one instance per engine worker process)."""

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
        self._pool: ThreadPoolExecutor | None = None
        self._loads: list[_Transfer] = []
        self._saves: list[_Transfer] = []
        self._load_error_blocks: set[int] = set()

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

        Raises ``grpc.RpcError`` when the gateway refuses (its message names the field).
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
        self._register()

    @property
    def registered(self) -> bool:
        """True once KV memory was registered (loads and stores are possible)."""
        return self._registration is not None

    def _register(self) -> None:
        assert self._registration is not None
        with self._register_lock:
            resp = self.client.register_kv_cache(
                self._registration, timeout=self.config.register_timeout_s
            )
        self._check_chunk_size(resp.chunk_size)
        logger.info(
            "engine %s registered with gateway %s (chunk size %d, storage %s)",
            self.engine_id,
            self.config.gateway,
            resp.chunk_size,
            resp.storage_instance_id or "?",
        )

    def _prompt_range(self, op: RetrieveOp | StoreOp) -> gateway_pb2.PromptRange:
        return gateway_pb2.PromptRange(
            request_id=op.request_id,
            model_name=self.config.model_name,
            world_size=self.config.world_size,
            cache_salt=op.cache_salt,
            token_ids=op.token_ids,
            start_token=op.start,
            end_token=op.end,
        )

    def _with_reregister(self, call: str, fn: Callable[[], _Resp]) -> _Resp:
        """Run ``fn``; if the gateway forgot this engine (it restarted), register and retry once."""
        try:
            return fn()
        except grpc.RpcError as exc:
            if (
                status_code(exc) != grpc.StatusCode.FAILED_PRECONDITION
                or self._registration is None
            ):
                raise
            logger.warning(
                "%s: gateway does not know engine %s; registering again", call, self.engine_id
            )
            self._register()
            return fn()

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=self.config.transfer_threads, thread_name_prefix="kvmesh-transfer"
            )
        return self._pool

    def _retrieve(self, op: RetrieveOp, producer_event: bytes = b"") -> list[int]:
        """Run one retrieve; the block ids it could not fill (empty on success)."""
        skip_blocks = op.skip_first_n_tokens // self.config.block_size
        if self._registration is None:
            logger.warning("retrieve of %s before register_kv_caches", op.request_id)
            return list(op.block_ids[skip_blocks:])
        request = gateway_pb2.RetrieveRequest(
            engine_id=self.engine_id,
            range=self._prompt_range(op),
            block_ids=op.block_ids,
            skip_first_n_tokens=op.skip_first_n_tokens,
            producer_event_handle=producer_event,
        )
        try:
            resp = self._with_reregister(
                "retrieve", lambda: self.client.retrieve(request, timeout=self._timeout)
            )
        except grpc.RpcError as exc:
            logger.warning("retrieve of %s failed: %s", op.request_id, rpc_failure(exc))
            return list(op.block_ids[skip_blocks:])
        loaded = resp.retrieved_chunks * self.chunk_size
        if op.start + loaded >= op.end:
            return []
        first_missing = max(loaded // self.config.block_size, skip_blocks)
        logger.warning(
            "retrieve of %s got %d of %d tokens", op.request_id, loaded, op.end - op.start
        )
        return list(op.block_ids[first_missing:])

    def _store(self, op: StoreOp, producer_event: bytes = b"") -> list[int]:
        """Run one store; [] on success, else the op's block ids."""
        if self._registration is None:
            logger.warning("store of %s before register_kv_caches", op.request_id)
            return list(op.block_ids)
        if self.gateway_down():
            return list(op.block_ids)
        request = gateway_pb2.StoreRequest(
            engine_id=self.engine_id,
            range=self._prompt_range(op),
            block_ids=op.block_ids,
            producer_event_handle=producer_event,
        )
        try:
            resp = self._with_reregister(
                "store", lambda: self.client.store(request, timeout=self._timeout)
            )
        except grpc.RpcError as exc:
            self._note_failure(f"store of {op.request_id}", exc)
            return list(op.block_ids)
        self._note_ok()
        if resp.skipped_chunks:
            logger.info(
                "store of %s: %d chunks did not fit in L1", op.request_id, resp.skipped_chunks
            )
        return []

    def start_load_kv(self, metadata: ConnectorMetadata, producer_event: bytes = b"") -> None:
        """Start the step's retrieves (before the forward pass).

        ``producer_event`` (GPU): IPC handle of a CUDA event recorded on the
        engine's stream; storage's copies into the blocks wait for it.
        """
        self._require(KVConnectorRole.WORKER)
        for op in metadata.retrieve_ops:
            future = self._executor().submit(self._retrieve, op, producer_event)
            self._loads.append(_Transfer(op.request_id, future))

    def wait_for_load(self) -> set[str]:
        """Wait for the started retrieves; the ids of requests whose load fell short."""
        failed: set[str] = set()
        for transfer in self._loads:
            missing = transfer.future.result()
            if missing:
                failed.add(transfer.request_id)
                self._load_error_blocks.update(missing)
        self._loads = []
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks that retrieves failed to fill since the last call (the engine recomputes them)."""
        blocks, self._load_error_blocks = self._load_error_blocks, set()
        return blocks

    def save_kv(self, metadata: ConnectorMetadata, producer_event: bytes = b"") -> None:
        """Start the step's stores (after the forward pass wrote the KV).

        ``producer_event`` (GPU): IPC handle of a CUDA event recorded after the
        forward; storage's copies out of the blocks wait for it.
        """
        self._require(KVConnectorRole.WORKER)
        for op in metadata.store_ops:
            future = self._executor().submit(self._store, op, producer_event)
            self._saves.append(_Transfer(op.request_id, future))

    def poll_saves(self) -> tuple[set[str], set[str]]:
        """Without blocking: (requests whose started stores all finished, requests still storing).

        Finished stores are forgotten; a failed store counts as finished (it was logged).
        """
        running = {t.request_id for t in self._saves if not t.future.done()}
        done = {t.request_id for t in self._saves if t.future.done()} - running
        self._saves = [t for t in self._saves if not t.future.done()]
        return done, running

    def wait_for_save(self) -> set[str]:
        """Wait for the started stores; the ids of requests whose store failed."""
        failed = {t.request_id for t in self._saves if t.future.result()}
        self._saves = []
        return failed
